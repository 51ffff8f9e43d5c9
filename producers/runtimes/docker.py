"""The ``docker`` runtime: one container per session (docker SDK), the harness run inside it by ``exec``.

**Workspace.** With ``spec.repo`` unset the workspace is the image's own repository at ``spec.workdir``
(default: the image's ``WORKDIR``), e.g. ``/testbed`` of a SWE-style task image: it must be a git work
tree's top level; ``base_commit``, when given, is checked out there (``git checkout --force --detach``,
then ``git clean -fd``), and ``HEAD`` is the handle's base commit. The patch is taken inside the container
(``git add -A`` into a throwaway index, ``git diff --cached --binary BASE``): everything in the work tree
but what ``.gitignore`` ignores. With ``spec.repo`` set, the workspace is prepared on this machine as the
local runtime prepares it and bind-mounted at ``spec.workdir`` (default ``/workspace``); the patch is a
host-side ``git diff`` (``producers.runtimes.workspace``). Either way git's ownership check is turned off
for the workspace (the session's HOME gets a ``.gitconfig`` with ``safe.directory = *``), and the
session's HOME is bind-mounted at ``/rollwire/home``. Bind mounts need an engine that sees this
machine's paths (a local engine, not a remote ``DOCKER_HOST``).

**Network** (``spec.network``). ``relay`` (default): the container has no network at all; the proxy is
reached through a Unix socket in a bind-mounted directory (``/rollwire/run``; host side
:mod:`producers.runtimes.relay`) that the container's main process, :mod:`producers.runtimes.container_relay`
(mounted read-only, run by the image's ``python3``), exposes on ``127.0.0.1:18080`` inside: the harness's
URL is ``http://127.0.0.1:18080/...`` (:meth:`DockerHandle.proxy_url_for`). ``host``: the host's network,
URLs unchanged. ``none``: no network and no proxy.

**Limits and labels.** ``cpus``, ``memory`` (swap included: memswap = memory) and ``pids_limit`` (4096 when
unset) from the spec. Labels name the session, the node, this host, and the creating process with its
start time, so :mod:`producers.runtimes.reaper` can remove the containers of a creator that died.

**Images built here.** A spec with ``build`` (schemas.tasks.ImageBuild: a Harbor task's environment) has
its image built by :mod:`producers.runtimes.image_build` when the engine lacks it; a failed build fails
the init with the builder's reason.

**Harness CLIs.** An image labelled ``rollwire.harness_cache`` with this machine's ``harness_cache()``
carries the pinned CLIs at that path; otherwise the cache is mounted read-only there (when it exists).

**Processes.** The container's main process is the relay script, as a reaping init (without ``python3``
in the image, and not on the ``relay`` network, ``sleep infinity``); set-up commands, the harness and git
run as ``exec``s. A run that times out or is cancelled is ended by killing every process in the
container but its init (``kill -1``; the relay survives it), or, when no exec can start, by their host
pids: one run at a time per handle. The
container is removed on every path: teardown, a failed or cancelled init (even while the engine is still
creating it), and, when the creator died, the reaper. ``handle.start_s`` is the seconds from create to
ready (the relay listening).

**What the limits did.** A command that fails is asked whether the sandbox ended it, so that the gateway
node can blame the machine and not the model (schemas/attribution.py): ``oom_killed`` when the container's
``State.OOMKilled`` is set or the engine reported an ``oom`` event for the container while the command ran
(an exec'd process killed at the memory limit leaves the container running, and Docker sets
``State.OOMKilled`` only when the container itself ends, so the event is what shows it), and
``pids_limit_hit`` when the container's pids cgroup counted a fork refused at the limit while it ran (its
``pids.events``, read on this machine through the container's init's ``/proc/<pid>/cgroup``; None where
that cannot be read, e.g. a remote engine).

The ``docker`` package is the project's ``docker`` extra and is imported only when a container starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from producers.harness_install import harness_cache
from producers.runtimes.base import CommandResult, Runtime, RuntimeHandle, RuntimeInitError
from producers.runtimes.image_build import ImageBuilds
from producers.runtimes.local import default_root, remove_tree, setup_failure, write_files
from producers.runtimes.process import OUTPUT_TAIL_BYTES
from producers.runtimes.reaper import NODE_LABEL, SESSION_LABEL, creator_labels
from producers.runtimes.relay import MAX_SOCKET_PATH, SOCKET_NAME, SocketRelay
from producers.runtimes.workspace import GitError, prepare_workspace, workspace_patch
from schemas.tasks import RuntimeSpec, memory_bytes

CONTAINER_HOME = "/rollwire/home"
CONTAINER_RUN = "/rollwire/run"
CONTAINER_RELAY_SCRIPT = "/rollwire/relay.py"
RELAY_SCRIPT = Path(__file__).with_name("container_relay.py")
RELAY_PORT = 18080
"""Where the proxy is, inside a ``relay`` container: ``http://127.0.0.1:18080``."""
RELAY_READY_S = 30.0
KILL_WAIT_S = 5.0
"""How long a killed run may take to end before its processes are killed from this machine."""
DEFAULT_WORKDIR = "/workspace"
DEFAULT_PIDS_LIMIT = 4096
HARNESS_CACHE_LABEL = "rollwire.harness_cache"
PATCH_LIMIT_BYTES = 64 * 1024 * 1024
_GIT_ENV = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*",
            "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
_GITCONFIG = "[safe]\n\tdirectory = *\n"

# Run in the container's workdir with the base commit as $1: check out, clean, say HEAD.
_PREPARE_SCRIPT = r"""
top=$(git rev-parse --show-toplevel 2>&1) || { echo "$(pwd) is not a git repository: $top" >&2; exit 3; }
[ "$top" = "$(pwd -P)" ] || { echo "$(pwd) is inside the git repository $top, not its top level" >&2; exit 3; }
if [ -n "$1" ]; then
  git checkout --quiet --force --detach "$1" || exit 4
  git clean -fdq || exit 4
fi
git rev-parse --verify HEAD || { echo "the repository has no commit" >&2; exit 4; }
"""

# Run in the workdir with the base commit as $1: the work tree's diff against it, new files included.
_PATCH_SCRIPT = r"""
scratch=$(mktemp -d) || exit 5
trap 'rm -rf "$scratch"' EXIT
export GIT_INDEX_FILE="$scratch/index"
git read-tree "$1" && git add -A -- . && git diff --cached --binary --full-index --no-color --no-ext-diff \
  --no-textconv --no-renames --src-prefix=a/ --dst-prefix=b/ "$1"
"""


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


def relay_url(url: str, port: int = RELAY_PORT) -> str:
    """``url`` as a ``relay`` container reaches it: its host and port become ``127.0.0.1:<port>``."""
    parts = urlsplit(url)
    netloc = f"127.0.0.1:{port}"
    if parts.username or parts.password:
        netloc = f"{parts.netloc.rsplit('@', 1)[0]}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _target(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"proxy URL {url!r} has no host")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


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


def _exec_whole(api: Any, container_id: str, argv: Sequence[str], env: Mapping[str, str], workdir: str,
                limit: int) -> tuple[int | None, bytes, bytes]:
    """One ``docker exec`` to its end, its whole stdout kept (ValueError past ``limit`` bytes)."""
    exec_id = api.exec_create(container_id, cmd=list(argv), environment=dict(env), workdir=workdir)["Id"]
    stdout, stderr = bytearray(), bytearray()
    for out, err in api.exec_start(exec_id, stream=True, demux=True):
        if out:
            stdout += out
            if len(stdout) > limit:
                raise ValueError(f"output over {limit} bytes")
        _append_tail(stderr, err, OUTPUT_TAIL_BYTES)
    return api.exec_inspect(exec_id).get("ExitCode"), bytes(stdout), bytes(stderr)


class DockerHandle(RuntimeHandle):
    """One session's container; its HOME (and, with ``spec.repo``, its workspace) bind-mounted from
    ``host_root``."""

    def __init__(self, session_id: str, host_root: Path, run_dir: Path, workdir: str, network: str,
                 kill_grace_s: float) -> None:
        self.session_id = session_id
        self.workspace = workdir
        self.home = CONTAINER_HOME
        self.host_root = host_root
        self.run_dir = run_dir
        self.network = network
        self.base_commit = ""
        self.in_image = False
        """True when the workspace is the image's own repository (the patch is taken inside)."""
        self.start_s: float | None = None
        """Seconds from the container's create to its being ready (relay listening)."""
        self.container_id: str | None = None
        self.relay: SocketRelay | None = None
        self._container: Any = None
        self._starting: asyncio.Future[Any] | None = None
        self._kill_grace_s = kill_grace_s
        self._stdin_files = itertools.count()
        self._pids_events: Path | None = None
        self._pids_unreadable = False

    @property
    def host_workspace(self) -> Path | None:
        """The bind-mounted workspace on this machine; None when the workspace is in the image."""
        return None if self.in_image else self.host_root / "workspace"

    @property
    def host_home(self) -> Path:
        return self.host_root / "home"

    def proxy_url_for(self, proxy_url: str) -> str:
        if self.network != "relay":
            return proxy_url
        assert self.relay is not None
        self.relay.target(*_target(proxy_url))
        return relay_url(proxy_url)

    async def write_home_files(self, files: Mapping[str, str]) -> None:
        await asyncio.to_thread(write_files, self.host_home, files)

    def _api(self) -> tuple[Any, str]:
        if self._container is None:
            raise RuntimeError("the session's container was torn down")
        return self._container.client.api, self._container.id

    async def run(self, argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float,
                  stdin: str | None = None) -> CommandResult:
        api, container_id = self._api()
        if stdin is not None:
            # docker exec's stdin needs a hijacked socket; a file in the session's HOME does the same job.
            name = f".rollwire/stdin-{next(self._stdin_files)}"
            await self.write_home_files({name: stdin})
            argv = ["sh", "-c", 'exec "$@" < "$0"', f"{CONTAINER_HOME}/{name}", *argv]
        started, since = time.monotonic(), time.time()
        pids_refused = await asyncio.to_thread(self._pids_refused)
        task = asyncio.ensure_future(asyncio.to_thread(
            _exec_blocking, api, container_id, argv, {**env, "HOME": self.home}, self.workspace,
            OUTPUT_TAIL_BYTES))
        try:
            exit_code, stdout, stderr = await asyncio.wait_for(asyncio.shield(task), timeout_s)
            timed_out = False
        except asyncio.TimeoutError:
            await self.kill_all()
            _, stdout, stderr = await self._ended(task)
            exit_code, timed_out = None, True
        except BaseException:
            await asyncio.shield(self.kill_all(grace_s=0))
            raise
        oom_killed = pids_limit_hit = None
        if exit_code != 0 and not timed_out:
            oom_killed, pids_limit_hit = await asyncio.to_thread(self._limits_hit, since, pids_refused)
        return CommandResult(exit_code=exit_code, stdout=stdout.decode(errors="replace"),
                             stderr=stderr.decode(errors="replace"), timed_out=timed_out,
                             duration_s=time.monotonic() - started, oom_killed=oom_killed,
                             pids_limit_hit=pids_limit_hit)

    def _limits_hit(self, since: float, pids_refused: int | None) -> tuple[bool | None, bool | None]:
        """After a failed command that started at ``since`` (wall clock): whether the memory limit killed a
        process meanwhile, and whether a fork was refused at the pids limit (see the module docstring);
        None for what could not be asked."""
        oom: bool | None = None
        with contextlib.suppress(Exception):  # the engine's answer is evidence, not a condition of the run
            container = self._container
            container.reload()
            oom = bool(container.attrs["State"].get("OOMKilled"))
            if not oom:
                events = container.client.api.events(
                    since=int(since) - 1, until=f"{time.time():.9f}",
                    filters={"container": container.id, "event": "oom"}, decode=True)
                try:
                    oom = any(True for _ in events)
                finally:
                    events.close()
        after = self._pids_refused()
        return oom, None if pids_refused is None or after is None else after > pids_refused

    def _pids_refused(self) -> int | None:
        """The forks the container's pids cgroup has refused at its limit so far (``max`` in its
        ``pids.events``, cgroup v1 or v2); None where this machine cannot read it."""
        if self._pids_unreadable:
            return None
        try:
            if self._pids_events is None:
                container = self._container
                container.reload()
                self._pids_events = _pids_events_file(int(container.attrs["State"]["Pid"]))
            for line in self._pids_events.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "max":
                    return int(value)
        except Exception:  # no container, a remote engine, no such cgroup file: nothing to tell
            self._pids_unreadable = self._pids_events is None
            return None
        return None

    async def _ended(self, task: asyncio.Future[tuple[int | None, bytes, bytes]]) -> tuple[int | None, bytes, bytes]:
        """The killed run's end. When the in-container kill could not run (no pid left for an exec: a fork
        bomb at the pids limit), its processes are killed from this machine by their host pids; a run that
        still does not end is given up on (teardown removes the container)."""
        for attempt in range(2):
            try:
                return await asyncio.wait_for(asyncio.shield(task), KILL_WAIT_S)
            except asyncio.TimeoutError:
                if attempt == 0:
                    await asyncio.to_thread(self._kill_from_host)
        return None, b"", b"the run's processes could not be killed; the container is removed at teardown"

    def _kill_from_host(self) -> None:
        """SIGKILL the container's processes but its init, by host pid (``docker top``); best effort."""
        with contextlib.suppress(Exception):
            container = self._container
            container.reload()
            init = str(container.attrs["State"]["Pid"])
            for row in container.top(ps_args="-o pid")["Processes"]:
                if row[0] != init:
                    with contextlib.suppress(OSError):
                        os.kill(int(row[0]), signal.SIGKILL)

    async def kill_all(self, grace_s: float | None = None) -> None:
        """End every process in the container but its init: SIGTERM, then SIGKILL after the grace period."""
        grace = self._kill_grace_s if grace_s is None else grace_s
        script = f"kill -TERM -1; sleep {grace:g}; kill -KILL -1" if grace > 0 else "kill -KILL -1"
        with contextlib.suppress(Exception):
            api, container_id = self._api()
            await asyncio.to_thread(_exec_blocking, api, container_id, ["sh", "-c", script], {}, "/", 4096)

    async def git_script(self, script: str, *args: str, limit: int = PATCH_LIMIT_BYTES) -> str:
        """Run a ``sh`` script in the workspace with git's ownership check off; its stdout (GitError on
        a non-zero exit)."""
        api, container_id = self._api()
        try:
            exit_code, stdout, stderr = await asyncio.to_thread(
                _exec_whole, api, container_id, ["sh", "-c", script, "rollwire", *args], _GIT_ENV,
                self.workspace, limit)
        except ValueError as exc:
            raise GitError(f"git in the container: {exc}") from exc
        if exit_code != 0:
            output = (stderr or stdout).decode(errors="replace")[-2000:].strip()
            raise GitError(f"git in the container exited {exit_code}: {output}")
        return stdout.decode(errors="replace")

    async def patch(self) -> str:
        if self.in_image:
            return await self.git_script(_PATCH_SCRIPT, self.base_commit)
        host_workspace = self.host_workspace
        assert host_workspace is not None
        return await workspace_patch(host_workspace, self.base_commit)

    async def teardown(self) -> None:
        starting, self._starting = self._starting, None
        container, self._container = self._container, None
        if container is None and starting is not None:
            try:  # init was interrupted while the engine created the container: wait for it, then remove it
                container = await starting
            except Exception:
                container = None
        if container is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(container.remove, force=True)
        relay, self.relay = self.relay, None
        if relay is not None:
            await relay.close()
        await asyncio.to_thread(remove_tree, self.host_root)
        if not self.run_dir.is_relative_to(self.host_root):
            await asyncio.to_thread(remove_tree, self.run_dir)


def _pids_events_file(pid: int) -> Path:
    """The ``pids.events`` of process ``pid``'s pids cgroup, by its ``/proc/<pid>/cgroup`` line (v1's
    ``N:pids:/path`` or, without one, v2's ``0::/path``)."""
    lines = [line.split(":", 2) for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()]
    for _, controllers, path in lines:
        if "pids" in controllers.split(","):
            return Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "pids.events"
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and not controllers:
            return Path("/sys/fs/cgroup") / path.lstrip("/") / "pids.events"
    raise FileNotFoundError(f"process {pid} is in no pids cgroup")


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


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What the runtime needs to know of an image before starting it."""

    workdir: str
    labels: dict[str, str]


class DockerRuntime(Runtime):
    """Containers on the local Docker engine, session directories under ``root`` on this machine."""

    kind = "docker"

    def __init__(self, root: Path | None = None, *, kill_grace_s: float = 2.0,
                 mount_harness_cache: bool = True, node: str | None = None) -> None:
        self.root = root or default_root()
        self.kill_grace_s = kill_grace_s
        self.mount_harness_cache = mount_harness_cache
        self.node = node
        self._client: Any = None
        self._builds = ImageBuilds()

    def volumes(self, spec: RuntimeSpec, host_root: Path, workdir: str, *, run_dir: Path | None = None,
                image_labels: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
        """The container's bind mounts: the workspace (with ``spec.repo``), HOME, the relay's script (the
        container's init) and directory (``relay`` network), the harness cache (read-only, unless the
        image has it) and the spec's own."""
        volumes = {str(host_root / "home"): {"bind": CONTAINER_HOME, "mode": "rw"}}
        if spec.repo is not None:
            volumes[str(host_root / "workspace")] = {"bind": workdir, "mode": "rw"}
        if spec.network == "relay":
            volumes[str(run_dir or host_root / "run")] = {"bind": CONTAINER_RUN, "mode": "rw"}
        volumes[str(RELAY_SCRIPT)] = {"bind": CONTAINER_RELAY_SCRIPT, "mode": "ro"}
        cache = harness_cache()
        in_image = (image_labels or {}).get(HARNESS_CACHE_LABEL) == str(cache)
        if self.mount_harness_cache and not in_image and cache.is_dir():
            volumes[str(cache)] = {"bind": str(cache), "mode": "ro"}
        for text in spec.mounts:
            mount = parse_mount(text)
            volumes[mount.host] = mount.volume()
        return volumes

    def labels(self, session_id: str) -> dict[str, str]:
        """The container's labels: its session, node, host and creating process (see the reaper)."""
        labels = {SESSION_LABEL: session_id, **creator_labels()}
        if self.node:
            labels[NODE_LABEL] = self.node
        return labels

    async def init(self, session_id: str, spec: RuntimeSpec, *, timeout_s: float) -> DockerHandle:
        if not spec.image:
            raise RuntimeInitError("the docker runtime needs runtime.image")
        self.root.mkdir(parents=True, exist_ok=True)
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in session_id)[:32]
        host_root = Path(tempfile.mkdtemp(prefix=f"{safe_id}-", dir=self.root))
        (host_root / "home").mkdir()
        run_dir = host_root / "run"
        if len(os.fsencode(run_dir / SOCKET_NAME)) > MAX_SOCKET_PATH:  # a long ROLLWIRE_RUNTIME_ROOT
            run_dir = Path(tempfile.mkdtemp(prefix="rw-run-"))
        else:
            run_dir.mkdir()
        run_dir.chmod(0o755)
        handle = DockerHandle(session_id, host_root, run_dir, spec.workdir or DEFAULT_WORKDIR, spec.network,
                              self.kill_grace_s)
        try:
            async with asyncio.timeout(timeout_s):
                await self._prepare(handle, spec, timeout_s)
                return handle
        except BaseException as exc:
            await asyncio.shield(handle.teardown())
            if isinstance(exc, TimeoutError):
                raise RuntimeInitError(f"runtime init took longer than {timeout_s:g}s") from exc
            raise

    async def _prepare(self, handle: DockerHandle, spec: RuntimeSpec, timeout_s: float) -> None:
        assert spec.image is not None
        try:
            for text in spec.mounts:
                parse_mount(text)
        except ValueError as exc:
            raise RuntimeInitError(str(exc)) from exc
        if self._client is None:
            self._client = await asyncio.to_thread(docker_client)
        if spec.build is not None:  # bounded by the build's own timeout, within the init's
            await asyncio.to_thread(self._builds.ensure, self._client, spec.image, spec.build)
        image = await asyncio.to_thread(self._image, spec.image)
        handle.in_image = spec.repo is None
        if handle.in_image:
            handle.workspace = spec.workdir or image.workdir
            if not handle.workspace:
                raise RuntimeInitError(f"runtime.repo is unset, so the workspace is the image's repository, but "
                                       f"neither runtime.workdir nor {spec.image!r}'s WORKDIR names it")
        try:
            volumes = self.volumes(spec, handle.host_root, handle.workspace, run_dir=handle.run_dir,
                                   image_labels=image.labels)
        except ValueError as exc:
            raise RuntimeInitError(str(exc)) from exc
        if not handle.in_image:
            try:
                handle.base_commit = await prepare_workspace(spec.repo, spec.base_commit,
                                                             handle.host_root / "workspace")
            except GitError as exc:
                raise RuntimeInitError(f"workspace from {spec.repo!r}: {exc}") from exc
        await asyncio.to_thread(write_files, handle.host_home, {".gitconfig": _GITCONFIG})
        if spec.network == "relay":
            handle.relay = SocketRelay(handle.run_dir)
            await handle.relay.start()
        started = time.monotonic()
        handle._starting = asyncio.ensure_future(asyncio.to_thread(
            self._start_container, handle.session_id, spec, handle.workspace, volumes,
            handle.host_root.name))
        handle._container = await asyncio.shield(handle._starting)
        handle._starting = None
        handle.container_id = handle._container.id
        if spec.network == "relay":
            await self._relay_ready(handle)
        handle.start_s = time.monotonic() - started
        if handle.in_image:
            try:
                handle.base_commit = (await handle.git_script(_PREPARE_SCRIPT, spec.base_commit or "")).strip()
            except GitError as exc:
                raise RuntimeInitError(f"workspace {handle.workspace} in {spec.image!r}: {exc}") from exc
        for command in spec.setup:
            result = await handle.run(["sh", "-c", command], env={}, timeout_s=timeout_s)
            if result.exit_code != 0:
                raise setup_failure(command, result)

    def _image(self, name: str) -> ImageInfo:
        try:
            image = self._client.images.get(name)
        except Exception as exc:  # docker.errors.ImageNotFound, APIError
            raise RuntimeInitError(f"image {name!r} is not on this Docker engine (nothing is pulled; build it "
                                   f"first, e.g. with `rollwire images build`): {exc}") from exc
        config = image.attrs.get("Config") or {}
        return ImageInfo(workdir=config.get("WorkingDir") or "", labels=dict(config.get("Labels") or {}))

    def _start_container(self, session_id: str, spec: RuntimeSpec, workdir: str,
                         volumes: dict[str, dict[str, str]], name: str) -> Any:
        if spec.network == "relay":
            entrypoint = ["python3", CONTAINER_RELAY_SCRIPT, "--listen", f"127.0.0.1:{RELAY_PORT}",
                          "--socket", f"{CONTAINER_RUN}/{SOCKET_NAME}", "--ready", f"{CONTAINER_RUN}/relay.ready"]
        else:  # the relay script as a reaping init where the image has python3
            entrypoint = ["sh", "-c", f'command -v python3 >/dev/null && exec python3 {CONTAINER_RELAY_SCRIPT}; '
                          'exec sleep infinity']
        limits: dict[str, Any] = {"pids_limit": spec.pids_limit or DEFAULT_PIDS_LIMIT}
        if spec.cpus is not None:
            limits["nano_cpus"] = int(spec.cpus * 1e9)
        if spec.memory is not None:
            limits["mem_limit"] = limits["memswap_limit"] = memory_bytes(spec.memory)
        try:
            container = self._client.containers.create(
                spec.image, entrypoint=entrypoint, command=[], name=f"rollwire-{name}", working_dir=workdir,
                environment={**spec.env, "HOME": CONTAINER_HOME}, volumes=volumes,
                network_mode="host" if spec.network == "host" else "none", labels=self.labels(session_id),
                **limits)
        except Exception as exc:  # docker.errors.ImageNotFound, APIError, …
            raise RuntimeInitError(f"container from {spec.image!r} could not be created: {exc}") from exc
        try:
            container.start()
        except Exception as exc:
            with contextlib.suppress(Exception):
                container.remove(force=True)
            hint = " (the relay network needs python3 in the image)" if spec.network == "relay" else ""
            raise RuntimeInitError(f"container from {spec.image!r} did not start{hint}: {exc}") from exc
        return container

    async def _relay_ready(self, handle: DockerHandle) -> None:
        """Wait until the container's relay listens (its ready file appears); fail if the container exits."""
        ready = handle.run_dir / "relay.ready"
        deadline = time.monotonic() + RELAY_READY_S
        next_check = time.monotonic() + 0.5
        while not ready.exists():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                container = handle._container
                await asyncio.to_thread(container.reload)
                if container.status not in ("created", "running"):
                    logs = (await asyncio.to_thread(container.logs)).decode(errors="replace")[-2000:].strip()
                    raise RuntimeInitError(f"the proxy relay in the container exited ({container.status}; the "
                                           f"relay network needs python3 in the image): {logs}")
            if now >= deadline:
                raise RuntimeInitError(f"the proxy relay in the container did not start within {RELAY_READY_S:g}s")
            await asyncio.sleep(0.01)
