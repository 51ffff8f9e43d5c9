"""The Docker engine rollwire's containers run on: found, adopted, or started here, and stopped.

``find_engine`` looks for an engine that answers a ping, in order: ``$DOCKER_HOST``, the system socket
(``unix:///var/run/docker.sock``) and rollwire's own socket (``<cache>/docker/docker.sock``, the cache
being ``$ROLLWIRE_CACHE_DIR`` or ``~/.cache/rollwire``). ``ensure_engine`` adopts the first that answers,
and otherwise starts rollwire's own ``dockerd`` (Debian's ``docker.io``, 20.10) so that it leaves the
host's network alone::

    dockerd --data-root <cache>/docker/data --exec-root /tmp/rw-dexec --pidfile <cache>/docker/dockerd.pid
            -H unix://<cache>/docker/docker.sock --bridge=none --iptables=false --ip-masq=false

(log: ``<cache>/docker/dockerd.log``). The data root sits in the cache so images persist across runs;
the exec root is a short path under /tmp because containerd's sockets live there and a Unix socket path
is limited to 108 bytes. The daemon's default network is ``none``; ``--network host`` works. It is ready
in a few seconds; ``ensure_engine`` waits up to 30 s and otherwise fails with the end of the log. A file
lock (``<cache>/docker/dockerd.lock``) keeps two processes from starting two daemons; a pid file whose pid
is not a running dockerd (a daemon killed, a machine restarted: the pid may be another process's by now,
and dockerd would refuse to start over it) is removed first. Either way the
engine's URL is exported as ``DOCKER_HOST`` so the Docker SDK (``docker.from_env()``) and the ``docker``
CLI reach it.

``stop_engine`` stops only a daemon rollwire started (by its pid file): SIGTERM, then SIGKILL after 20 s,
then unmounts what it left under ``<exec-root>/netns``. ``reap_containers`` removes the containers the
docker runtime labelled ``rollwire.session`` (sessions whose node died, or every one). Used by
``rollwire docker up|down|status|reap`` and by the tests.

Needs ``dockerd`` only when no engine answers: ``apt-get install -y docker.io`` (and ``debootstrap`` for
``rollwire images build``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from deploy.errors import DeployError, MissingToolError
from deploy.kafka_dist import file_lock
from schemas import paths

SYSTEM_SOCKET_URL = "unix:///var/run/docker.sock"
SESSION_LABEL = "rollwire.session"
DEFAULT_EXEC_ROOT = Path("/tmp/rw-dexec")
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 20.0
_LOG_TAIL_BYTES = 3000
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
_DOCKERD_FALLBACKS = ("/usr/sbin/dockerd", "/usr/bin/dockerd")  # for a PATH without sbin
_INSTALL_HINT = "apt-get install -y docker.io debootstrap"


class DockerEngineError(DeployError):
    """No Docker engine answers and rollwire's own could not be started or stopped."""


def cache_dir() -> Path:
    """rollwire's cache (``$ROLLWIRE_CACHE_DIR``, default ``~/.cache/rollwire``)."""
    return paths.cache_dir()


def _default_exec_root(root: Path) -> Path:
    """``/tmp/rw-dexec`` for the default engine, a short per-root path for any other."""
    if root == cache_dir() / "docker":
        return DEFAULT_EXEC_ROOT
    return Path(f"/tmp/rw-dexec-{hashlib.sha1(str(root).encode()).hexdigest()[:8]}")


@dataclass(frozen=True)
class EngineConfig:
    """Where rollwire's own dockerd keeps its state, its socket, pid file and log."""

    root: Path = field(default_factory=lambda: cache_dir() / "docker")
    exec_root: Path | None = None  # default: /tmp/rw-dexec for the default root, else /tmp/rw-dexec-<hash>

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).expanduser())
        if self.exec_root is None:
            object.__setattr__(self, "exec_root", _default_exec_root(self.root))

    @property
    def exec_dir(self) -> Path:
        assert self.exec_root is not None
        return self.exec_root

    @property
    def data_root(self) -> Path:
        return self.root / "data"

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def pid_file(self) -> Path:
        return self.root / "dockerd.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def lock_file(self) -> Path:
        return self.root / "dockerd.lock"

    def argv(self, dockerd: str) -> list[str]:
        return [dockerd, "--data-root", str(self.data_root), "--exec-root", str(self.exec_dir),
                "--pidfile", str(self.pid_file), "-H", self.url,
                "--bridge=none", "--iptables=false", "--ip-masq=false"]


def client_for(url: str, timeout_s: float = 60.0) -> Any:
    """A Docker SDK client of the engine at ``url``."""
    try:
        import docker
    except ImportError as exc:  # the project's 'docker' dependency
        raise DockerEngineError("the Docker SDK (the 'docker' package) is not installed in this environment") from exc
    return docker.DockerClient(base_url=url, timeout=int(timeout_s))


def engine_answers(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a Docker engine at ``url`` answers ``/_ping``."""
    if url.startswith("unix://") and not Path(url[len("unix://"):]).exists():
        return False
    try:
        client = client_for(url, timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except DockerEngineError:
        raise
    except Exception:  # docker.errors.DockerException, requests' connection errors
        return False


def candidate_urls(config: EngineConfig | None = None) -> list[str]:
    """Where an engine is looked for, in order: $DOCKER_HOST, the system socket, rollwire's own socket."""
    config = config or EngineConfig()
    urls = [os.environ.get("DOCKER_HOST", "").strip(), SYSTEM_SOCKET_URL, config.url]
    return [url for i, url in enumerate(urls) if url and url not in urls[:i]]


def find_engine(config: EngineConfig | None = None) -> str | None:
    """The URL of the first engine that answers (see :func:`candidate_urls`), or None."""
    for url in candidate_urls(config):
        if engine_answers(url):
            return url
    return None


def _export(url: str) -> str:
    os.environ["DOCKER_HOST"] = url
    return url


def daemon_pid(config: EngineConfig) -> int | None:
    """The pid of the dockerd recorded in ``config``'s pid file, if that process is alive and a dockerd."""
    try:
        pid = int(config.pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"dockerd" in cmdline else None


def _log_tail(config: EngineConfig) -> str:
    try:
        with open(config.log_file, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - _LOG_TAIL_BYTES))
            return handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def dockerd_path() -> str:
    """The ``dockerd`` executable; :class:`MissingToolError` naming the package when it is missing."""
    found = shutil.which("dockerd") or next((p for p in _DOCKERD_FALLBACKS if os.access(p, os.X_OK)), None)
    if found is None:
        raise MissingToolError(f"no Docker engine answers ({', '.join(candidate_urls())}) and dockerd is not "
                               f"installed: run `{_INSTALL_HINT}` (Docker 20.10 from Debian; about 30 s), "
                               "or set DOCKER_HOST to an engine that runs")
    return found


def _wait_until_answers(config: EngineConfig, process: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine_answers(config.url, timeout_s=2.0):
            return
        if process is not None and process.poll() is not None:
            raise DockerEngineError(f"dockerd exited with code {process.returncode} while starting; the end of "
                                    f"{config.log_file}:\n{_log_tail(config)}")
        time.sleep(0.2)
    raise DockerEngineError(f"dockerd did not answer at {config.url} within {timeout_s:.0f} s; the end of "
                            f"{config.log_file}:\n{_log_tail(config)}")


def start_engine(config: EngineConfig | None = None, timeout_s: float = _START_TIMEOUT_S) -> str:
    """Start rollwire's own dockerd for ``config`` unless it already answers; its URL once it answers.

    Other engines are not looked at (see :func:`ensure_engine`). Holds ``config.lock_file`` while starting,
    so a second process waits and then finds the first one's daemon.
    """
    config = config or EngineConfig()
    for socket_path in (config.socket, config.exec_dir / "containerd" / "containerd.sock.ttrpc"):
        if len(str(socket_path)) > _MAX_SOCKET_PATH:
            raise DockerEngineError(f"{socket_path} is longer than a Unix socket path may be ({_MAX_SOCKET_PATH} "
                                    "bytes): use a shorter ROLLWIRE_CACHE_DIR or exec root")
    config.root.mkdir(parents=True, exist_ok=True)
    with file_lock(config.lock_file):
        if engine_answers(config.url):
            return config.url
        if daemon_pid(config) is not None:  # started by someone else and still coming up: wait for it
            _wait_until_answers(config, None, timeout_s)
            return config.url
        # A pid file left by a daemon that is gone (killed, the machine restarted) names a pid that may
        # belong to another process by now, and dockerd refuses to start over a pid file whose pid is alive.
        config.pid_file.unlink(missing_ok=True)
        dockerd = dockerd_path()
        config.exec_dir.mkdir(parents=True, exist_ok=True)
        config.data_root.mkdir(parents=True, exist_ok=True)
        with open(config.log_file, "ab") as log:
            log.write(f"\n--- rollwire starting dockerd {datetime.now(timezone.utc).isoformat()}\n".encode())
            log.flush()
            try:
                process = subprocess.Popen(config.argv(dockerd), stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                raise DockerEngineError(f"could not run {dockerd}: {exc}") from exc
        try:
            _wait_until_answers(config, process, timeout_s)
        except DockerEngineError:
            if process.poll() is None:
                process.kill()
                process.wait()
            raise
        return config.url


def ensure_engine(config: EngineConfig | None = None, timeout_s: float = _START_TIMEOUT_S,
                  adopt_others: bool = True) -> str:
    """The URL of an engine that answers, exported as ``DOCKER_HOST``: an existing one (``adopt_others``:
    $DOCKER_HOST, the system socket; always rollwire's own socket), else rollwire's own dockerd, started."""
    config = config or EngineConfig()
    found = find_engine(config) if adopt_others else (config.url if engine_answers(config.url) else None)
    return _export(found or start_engine(config, timeout_s))


def _mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first (from /proc/self/mountinfo)."""
    prefix = str(root).rstrip("/")
    points: list[str] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return points
    for line in lines:
        fields = line.split()
        if len(fields) > 4:
            point = fields[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return sorted(set(points), key=len, reverse=True)


def _unmount_leftovers(config: EngineConfig) -> list[str]:
    left = []
    for point in _mounts_under(config.exec_dir):
        done = subprocess.run(["umount", point], capture_output=True)
        if done.returncode != 0:
            done = subprocess.run(["umount", "-l", point], capture_output=True)
        if done.returncode != 0:
            left.append(point)
    return left


def stop_engine(config: EngineConfig | None = None, timeout_s: float = _STOP_TIMEOUT_S) -> bool:
    """Stop the dockerd rollwire started for ``config`` (by its pid file); False when none was running.

    Unmounts what the daemon left under ``<exec-root>/netns``; an engine rollwire did not start (the
    system's, another $DOCKER_HOST) is never touched.
    """
    config = config or EngineConfig()
    with file_lock(config.lock_file) if config.root.is_dir() else _no_lock():
        pid = daemon_pid(config)
        if pid is not None:
            _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                _signal(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
            if _alive(pid):
                raise DockerEngineError(f"dockerd (pid {pid}) outlived SIGKILL")
        left = _unmount_leftovers(config)
        if left:
            raise DockerEngineError(f"dockerd stopped but these mounts could not be unmounted: {', '.join(left)}")
        return pid is not None


class _no_lock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        raise DockerEngineError(f"not allowed to signal dockerd (pid {pid}): {exc}") from exc


def _alive(pid: int) -> bool:
    """Alive and not a zombie (a daemon started by this process is reaped here when it has exited)."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def engine_status(config: EngineConfig | None = None) -> dict[str, object]:
    """Which engine answers (URL, version, data root, containers, images) and whether rollwire's runs."""
    config = config or EngineConfig()
    url = find_engine(config)
    report: dict[str, object] = {"url": url, "answers": url is not None, "own_socket": config.url,
                                 "own_pid": daemon_pid(config), "own_log": str(config.log_file)}
    if url is not None:
        client = client_for(url)
        try:
            info = client.info()
            report.update({"server_version": info.get("ServerVersion"), "data_root": info.get("DockerRootDir"),
                           "containers": info.get("Containers"), "containers_running": info.get("ContainersRunning"),
                           "images": info.get("Images"),
                           "session_containers": len(client.containers.list(all=True, ignore_removed=True,
                                                                            filters={"label": SESSION_LABEL}))})
        finally:
            client.close()
    return report


@dataclass(frozen=True)
class ReapedContainer:
    name: str
    session_id: str
    status: str
    age_s: float


def _created_at(value: object) -> float:
    """Docker's creation time (RFC 3339 with nanoseconds from inspect, epoch seconds from list) as epoch seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    head, _, rest = str(value).rstrip("Z").partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())[:6]
    stamp = datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return stamp + (float(f"0.{fraction}") if fraction else 0.0)


def reap_containers(url: str | None = None, older_than_s: float = 0.0, include_running: bool = True,
                    labels: Sequence[str] = (SESSION_LABEL,)) -> list[ReapedContainer]:
    """Remove (force) the containers carrying every one of ``labels`` (``key`` or ``key=value``) created
    more than ``older_than_s`` ago, running ones only with ``include_running``; what was removed.

    Every session container, whoever made it: ``producers.runtimes.reaper.reap_orphans`` is the careful
    pass (only this host's containers whose creating process is gone)."""
    client = client_for(url or ensure_engine())
    removed: list[ReapedContainer] = []
    try:
        for container in client.containers.list(all=True, ignore_removed=True, filters={"label": list(labels)}):
            age = time.time() - _created_at(container.attrs.get("Created", ""))
            if age < older_than_s or (container.status == "running" and not include_running):
                continue
            try:
                container.remove(force=True)
            except Exception as exc:  # docker.errors.NotFound: removed by its own runtime meanwhile
                if type(exc).__name__ == "NotFound":
                    continue
                raise DockerEngineError(f"could not remove container {container.name}: {exc}") from exc
            removed.append(ReapedContainer(container.name, (container.labels or {}).get(SESSION_LABEL, ""),
                                           container.status, age))
    finally:
        client.close()
    return removed
