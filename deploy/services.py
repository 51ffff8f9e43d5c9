"""rollwire's own services (the proxy, the processors) as detached local processes.

A :class:`ServiceProcess` runs one ``python -m deploy.cli <command>`` in its own session with a pid file
and a log under ``$ROLLWIRE_HOME/<name>/``, waits for its health URL (or, for a service without one such
as an evaluator, for it to stay alive a few seconds), and stops it with SIGTERM (then SIGKILL). ``rollwire up/down/status`` drive them beside the broker and the engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deploy.errors import DeployError
from schemas import paths


class ServiceStartError(DeployError):
    """A rollwire service died while starting or did not become healthy in time."""


@dataclass(frozen=True)
class ServiceProcess:
    """One rollwire service run in the background."""

    name: str
    args: tuple[str, ...]
    health_url: str | None
    env: dict[str, str] = field(default_factory=dict)
    settle_s: float = 3.0  # without a health URL: how long it must stay alive to count as started
    home: Path = field(default_factory=paths.home)

    @property
    def pid_file(self) -> Path:
        return self.home / self.name / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.home / self.name / f"{self.name}.log"

    def pid(self) -> int | None:
        """The pid in the pid file, if that process runs the command line the file recorded (a file from
        before commands were recorded: this handle's own arguments; ``deploy.cli`` alone when it has none).
        A pid file left by a service that is gone (killed, the machine restarted) may name a pid another
        process has by now, another rollwire command included: that one is never taken for this service,
        nor stopped as it."""
        try:
            lines = self.pid_file.read_text().splitlines()
            pid = int(lines[0].strip())
            recorded = json.loads(lines[1]) if len(lines) > 1 else list(self.args)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return None
        if not isinstance(recorded, list) or not all(isinstance(arg, str) for arg in recorded):
            return None
        return pid if _command_line(recorded) in cmdline + b"\0" else None

    def record(self, pid: int) -> None:
        """Write the pid file: ``pid``, and this service's command line (how :meth:`pid` knows it again)."""
        self.pid_file.write_text(f"{pid}\n{json.dumps(list(self.args))}\n")

    def healthy(self) -> bool:
        if self.health_url is None:
            return self.pid() is not None
        try:
            return httpx.get(self.health_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout_s: float = 60) -> None:
        """Start the service unless it already runs; return once it answers its health URL."""
        if self.pid() is not None and self.healthy():
            return
        if self.pid() is None and self.health_url is not None and self.healthy():
            # Another process (an earlier stack with another ROLLWIRE_HOME, a stray worker) holds the port:
            # its answers would pass for ours while ours dies on the taken address.
            raise ServiceStartError(f"something that is not this stack's {self.name} already answers "
                                    f"{self.health_url}; stop it or move {self.name} to a free port")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            process = subprocess.Popen([sys.executable, "-m", "deploy.cli", *self.args], stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, **self.env}, start_new_session=True)
        self.record(process.pid)
        deadline = time.monotonic() + (timeout_s if self.health_url is not None else self.settle_s)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = "\n".join(self.log_file.read_text(errors="replace").splitlines()[-30:])
                self.pid_file.unlink(missing_ok=True)
                raise ServiceStartError(f"{self.name} exited with code {process.returncode}:\n{tail}")
            if self.health_url is not None and self.healthy():
                return
            time.sleep(0.3)
        if self.health_url is None:
            return
        self.stop()
        raise ServiceStartError(f"{self.name} did not answer {self.health_url} within {timeout_s:.0f} s; "
                                f"see {self.log_file}")

    def stop(self, timeout_s: float = 15) -> None:
        pid = self.pid()
        if pid is not None:
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.pid() is not None:
                os.killpg(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        return {"running": self.pid() is not None, "pid": self.pid(), "healthy": self.healthy(),
                "log": str(self.log_file)}


def _command_line(args: list[str]) -> bytes:
    """``deploy.cli`` and ``args`` as they appear, whole, in a process's /proc/<pid>/cmdline."""
    return b"\0".join([b"deploy.cli", *(os.fsencode(arg) for arg in args)]) + b"\0"
