"""The ``docker`` runtime: one container per session (docker SDK), the harness run inside it by ``exec``.

The workspace is prepared on this machine exactly as the local runtime prepares it (same base commit,
same patch) and **bind-mounted** at the spec's ``workdir`` (default ``/workspace``); the session's HOME is
bind-mounted at ``/rollwire/home``. Bind mounts keep the patch a host-side ``git diff`` (images need no
git) and make set-up output and harness edits visible without copying; the price is that the Docker
engine must see this machine's paths (a local engine, not a remote ``DOCKER_HOST``). The harness cache
(``producers.harness_install``) is mounted read-only at its own path, so an adapter's executable path
works unchanged where the image has Node.js.

The container's main process only sleeps; set-up commands and the harness are ``exec``s. A run that
times out or is cancelled is ended by killing every process in the container but its init
(``kill -1``): one run at a time per handle. Harnesses reach the proxy on the host as
``host.docker.internal`` (``proxy_url_for``; the host-gateway entry is added to the container), so the
proxy must listen on an address the container can reach (not only 127.0.0.1).

The ``docker`` package is the project's ``docker`` extra and is imported only when a container starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from producers.harness_install import harness_cache
from producers.runtimes.base import CommandResult, Runtime, RuntimeHandle, RuntimeInitError
from producers.runtimes.local import default_root, remove_tree, setup_failure, write_files
from producers.runtimes.process import OUTPUT_TAIL_BYTES
from producers.runtimes.workspace import GitError, prepare_workspace, workspace_patch
from schemas.tasks import RuntimeSpec

CONTAINER_HOME = "/rollwire/home"
DEFAULT_WORKDIR = "/workspace"
HOST_ALIAS = "host.docker.internal"
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


@dataclass(frozen=True, slots=True)
class Mount:
    """One ``host:container[:ro|rw]`` bind mount of a runtime spec."""

    host: str
    container: str
    read_only: bool = False

    def volume(self) -> dict[str, str]:
        return {"bind": self.container, "mode": "ro" if self.read_only else "rw"}


def parse_mount(text: str) -> Mount:
    """``host:container[:ro|rw]`` → :class:`Mount` (both paths absolute; ``~`` expanded on the host side)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(parts[:2]):
        raise ValueError(f"mount {text!r}: expected 'host:container[:ro|rw]'")
    host, container = os.path.expanduser(parts[0]), parts[1]
    mode = parts[2] if len(parts) == 3 else "rw"
    if mode not in ("ro", "rw"):
        raise ValueError(f"mount {text!r}: mode must be 'ro' or 'rw', not {mode!r}")
    if not os.path.isabs(host) or not PurePosixPath(container).is_absolute():
        raise ValueError(f"mount {text!r}: both paths must be absolute")
    return Mount(host=host, container=container, read_only=mode == "ro")


def container_url(url: str) -> str:
    """``url`` as a container reaches it: a loopback host becomes ``host.docker.internal``."""
    parts = urlsplit(url)
    if parts.hostname not in _LOOPBACK:
        return url
    netloc = HOST_ALIAS if parts.port is None else f"{HOST_ALIAS}:{parts.port}"
    if parts.username or parts.password:
        netloc = f"{parts.netloc.rsplit('@', 1)[0]}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _append_tail(tail: bytearray, chunk: bytes | None, limit: int) -> None:
    if chunk:
        tail += chunk
        if len(tail) > limit:
            del tail[:len(tail) - limit]


def _exec_blocking(api: Any, container_id: str, argv: Sequence[str], env: Mapping[str, str], workdir: str,
                   limit: int) -> tuple[int | None, bytes, bytes]:
    """One ``docker exec`` to its end (blocking): exit code and output tails."""
    exec_id = api.exec_create(container_id, cmd=list(argv), environment=dict(env), workdir=workdir)["Id"]
    stdout, stderr = bytearray(), bytearray()
    for out, err in api.exec_start(exec_id, stream=True, demux=True):
        _append_tail(stdout, out, limit)
        _append_tail(stderr, err, limit)
    return api.exec_inspect(exec_id).get("ExitCode"), bytes(stdout), bytes(stderr)


class DockerHandle(RuntimeHandle):
    """One session's container, with its workspace and HOME bind-mounted from ``host_root``."""

    def __init__(self, session_id: str, host_root: Path, base_commit: str, container: Any, workdir: str,
                 kill_grace_s: float) -> None:
        self.session_id = session_id
        self.workspace = workdir
        self.home = CONTAINER_HOME
        self.host_root = host_root
        self.base_commit = base_commit
        self._container = container
        self._kill_grace_s = kill_grace_s
        self._stdin_files = itertools.count()

    @property
    def host_workspace(self) -> Path:
        return self.host_root / "workspace"

    @property
    def host_home(self) -> Path:
        return self.host_root / "home"

    async def write_home_files(self, files: Mapping[str, str]) -> None:
        await asyncio.to_thread(write_files, self.host_home, files)

    async def run(self, argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float,
                  stdin: str | None = None) -> CommandResult:
        if self._container is None:
            raise RuntimeError("the session's container was torn down")
        if stdin is not None:
            # docker exec's stdin needs a hijacked socket; a file in the session's HOME does the same job.
            name = f".rollwire/stdin-{next(self._stdin_files)}"
            await self.write_home_files({name: stdin})
            argv = ["sh", "-c", 'exec "$@" < "$0"', f"{CONTAINER_HOME}/{name}", *argv]
        started = time.monotonic()
        api = self._container.client.api
        task = asyncio.ensure_future(asyncio.to_thread(
            _exec_blocking, api, self._container.id, argv, {**env, "HOME": self.home}, self.workspace,
            OUTPUT_TAIL_BYTES))
        try:
            exit_code, stdout, stderr = await asyncio.wait_for(asyncio.shield(task), timeout_s)
            timed_out = False
        except asyncio.TimeoutError:
            await self._kill_all()
            _, stdout, stderr = await task
            exit_code, timed_out = None, True
        except BaseException:
            await asyncio.shield(self._kill_all(grace_s=0))
            raise
        return CommandResult(exit_code=exit_code, stdout=stdout.decode(errors="replace"),
                             stderr=stderr.decode(errors="replace"), timed_out=timed_out,
                             duration_s=time.monotonic() - started)

    async def _kill_all(self, grace_s: float | None = None) -> None:
        """End every process in the container but its init: SIGTERM, then SIGKILL after the grace period."""
        grace = self._kill_grace_s if grace_s is None else grace_s
        script = f"kill -TERM -1; sleep {grace:g}; kill -KILL -1" if grace > 0 else "kill -KILL -1"
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._container.exec_run, ["sh", "-c", script])

    async def patch(self) -> str:
        return await workspace_patch(self.host_workspace, self.base_commit)

    async def teardown(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(container.remove, force=True)
        await asyncio.to_thread(remove_tree, self.host_root)


def docker_client() -> Any:
    """A client of the local Docker engine, checked with a ping; :class:`RuntimeInitError` when none answers."""
    try:
        import docker
    except ImportError as exc:
        raise RuntimeInitError("the docker runtime needs the docker SDK (the 'docker' package), which is not installed") from exc
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # docker.errors.DockerException and the transport's own errors
        raise RuntimeInitError(f"no Docker engine answers: {exc}") from exc
    return client


class DockerRuntime(Runtime):
    """Containers on the local Docker engine, workspaces under ``root`` on this machine."""

    kind = "docker"

    def __init__(self, root: Path | None = None, *, kill_grace_s: float = 2.0,
                 mount_harness_cache: bool = True) -> None:
        self.root = root or default_root()
        self.kill_grace_s = kill_grace_s
        self.mount_harness_cache = mount_harness_cache
        self._client: Any = None

    def proxy_url_for(self, proxy_url: str) -> str:
        return container_url(proxy_url)

    def volumes(self, spec: RuntimeSpec, host_root: Path, workdir: str) -> dict[str, dict[str, str]]:
        """The container's bind mounts: workspace, HOME, the harness cache (read-only) and the spec's own."""
        volumes = {str(host_root / "workspace"): {"bind": workdir, "mode": "rw"},
                   str(host_root / "home"): {"bind": CONTAINER_HOME, "mode": "rw"}}
        cache = harness_cache()
        if self.mount_harness_cache and cache.is_dir():
            volumes[str(cache)] = {"bind": str(cache), "mode": "ro"}
        for text in spec.mounts:
            mount = parse_mount(text)
            volumes[mount.host] = mount.volume()
        return volumes

    async def init(self, session_id: str, spec: RuntimeSpec, *, timeout_s: float) -> DockerHandle:
        if not spec.image:
            raise RuntimeInitError("the docker runtime needs runtime.image")
        workdir = spec.workdir or DEFAULT_WORKDIR
        self.root.mkdir(parents=True, exist_ok=True)
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in session_id)[:64]
        host_root = Path(tempfile.mkdtemp(prefix=f"{safe_id}-", dir=self.root))
        (host_root / "home").mkdir()
        handle: DockerHandle | None = None
        try:
            async with asyncio.timeout(timeout_s):
                try:
                    volumes = self.volumes(spec, host_root, workdir)
                except ValueError as exc:
                    raise RuntimeInitError(str(exc)) from exc
                try:
                    base = await prepare_workspace(spec.repo, spec.base_commit, host_root / "workspace")
                except GitError as exc:
                    raise RuntimeInitError(f"workspace from {spec.repo!r}: {exc}") from exc
                if self._client is None:
                    self._client = await asyncio.to_thread(docker_client)
                container = await asyncio.to_thread(self._start_container, session_id, spec, workdir, volumes)
                handle = DockerHandle(session_id, host_root, base, container, workdir, self.kill_grace_s)
                for command in spec.setup:
                    result = await handle.run(["sh", "-c", command], env={}, timeout_s=timeout_s)
                    if result.exit_code != 0:
                        raise setup_failure(command, result)
                return handle
        except BaseException as exc:
            if handle is not None:
                await handle.teardown()
            else:
                await asyncio.to_thread(remove_tree, host_root)
            if isinstance(exc, TimeoutError):
                raise RuntimeInitError(f"runtime init took longer than {timeout_s:g}s") from exc
            raise

    def _start_container(self, session_id: str, spec: RuntimeSpec, workdir: str,
                         volumes: dict[str, dict[str, str]]) -> Any:
        try:
            return self._client.containers.run(
                spec.image, entrypoint=["sleep", "infinity"], command=[], detach=True, working_dir=workdir,
                environment={**spec.env, "HOME": CONTAINER_HOME}, volumes=volumes,
                extra_hosts={HOST_ALIAS: "host-gateway"}, labels={"rollwire.session": session_id})
        except Exception as exc:  # docker.errors.ImageNotFound, APIError, …
            raise RuntimeInitError(f"container from {spec.image!r} did not start: {exc}") from exc
