"""The reaper: removes session containers whose creator died without removing them (a node killed hard).

Every container the docker runtime starts carries labels saying who made it: ``rollwire.session``,
``rollwire.host`` (``socket.gethostname()``), ``rollwire.pid`` and ``rollwire.pid_start`` (that process's
start time in clock ticks since boot, field 22 of ``/proc/<pid>/stat``, so a pid reused by another
process does not pass for the creator). A pass removes the containers labelled for this host whose
creator is gone. Containers of other hosts, and ones without a creator label, are left alone.

The gateway node runs a pass at start and every minute; ``python -m producers.runtimes.reaper`` runs
one and prints what it removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SESSION_LABEL = "rollwire.session"
NODE_LABEL = "rollwire.node"
HOST_LABEL = "rollwire.host"
PID_LABEL = "rollwire.pid"
PID_START_LABEL = "rollwire.pid_start"


def process_start(pid: int) -> str | None:
    """``pid``'s start time (``/proc/<pid>/stat`` field 22), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 2 (comm) is parenthesized and may hold spaces: split after its closing parenthesis.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie has ended; it only waits for its parent to reap it
        return None
    return fields[19]  # fields[0] is field 3 (state), so field 22 is fields[19]


def creator_labels(pid: int | None = None) -> dict[str, str]:
    """The labels that name ``pid`` (default: this process) on this host as a container's creator."""
    pid = os.getpid() if pid is None else pid
    return {HOST_LABEL: socket.gethostname(), PID_LABEL: str(pid), PID_START_LABEL: process_start(pid) or ""}


def creator_alive(labels: dict[str, str]) -> bool | None:
    """Whether the process the labels name still runs; None when the labels name none."""
    try:
        pid = int(labels[PID_LABEL])
    except (KeyError, ValueError):
        return None
    start = process_start(pid)
    return start is not None and start == labels.get(PID_START_LABEL)


def reap_orphans(client: Any, *, host: str | None = None) -> list[str]:
    """Remove this host's session containers whose creator is gone; their names (or ids), as removed."""
    host = host or socket.gethostname()
    removed: list[str] = []
    containers = client.containers.list(all=True, ignore_removed=True,
                                        filters={"label": [SESSION_LABEL, f"{HOST_LABEL}={host}"]})
    for container in containers:
        labels = dict(container.labels or {})
        if labels.get(HOST_LABEL) != host or creator_alive(labels) is not False:
            continue
        try:
            container.remove(force=True)
        except Exception as exc:  # gone already (another reaper), or the engine refused
            if type(exc).__name__ != "NotFound":
                logger.warning("reaper: container %s not removed: %s", container.name, exc)
            continue
        logger.info("reaper: removed container %s of session %s (creator pid %s on %s is gone)",
                    container.name, labels.get(SESSION_LABEL), labels.get(PID_LABEL), host)
        removed.append(container.name or container.id)
    return removed


def reap_if_docker() -> list[str]:
    """One pass when the docker SDK imports and an engine answers; [] otherwise. Never raises."""
    try:
        import docker
    except ImportError:
        return []
    try:
        client = docker.from_env(timeout=30)
    except Exception:
        return []
    try:
        client.ping()
        return reap_orphans(client)
    except Exception as exc:
        logger.debug("reaper: no pass (%s)", exc)
        return []
    finally:
        with contextlib.suppress(Exception):
            client.close()


def main() -> int:
    try:
        import docker
        client = docker.from_env()
        client.ping()
    except Exception as exc:
        print(f"no Docker engine answers: {exc}", file=sys.stderr)
        return 1
    removed = reap_orphans(client)
    for name in removed:
        print(name)
    print(f"removed {len(removed)} orphaned container(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
