"""The ``local`` runtime: a private directory per session on this machine, ``workspace/`` and ``home/``.

The workspace comes from the task's repository at its base commit (``producers.runtimes.workspace``);
set-up commands run there with ``sh -c``. Commands run as their own process group with exactly the
environment they are given, plus the runtime's env (``RuntimeSpec.env``), ``HOME`` (the session's home)
and ``PATH`` (this process's, unless the caller gives one).

Sessions live under ``ROLLWIRE_RUNTIME_ROOT`` (default: ``rollwire-sessions`` in the temp directory).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from producers.runtimes.base import CommandResult, Runtime, RuntimeHandle, RuntimeInitError
from producers.runtimes.process import run_process_group
from producers.runtimes.workspace import GitError, prepare_workspace, workspace_patch
from schemas.tasks import RuntimeSpec

_SETUP_TAIL = 2000


def default_root() -> Path:
    """Where session directories go: ``ROLLWIRE_RUNTIME_ROOT`` or ``<tmp>/rollwire-sessions``."""
    configured = os.environ.get("ROLLWIRE_RUNTIME_ROOT")
    return Path(configured).expanduser() if configured else Path(tempfile.gettempdir()) / "rollwire-sessions"


def home_file_path(home: Path, relative: str) -> Path:
    """``relative`` under ``home``; refuses absolute paths and ones that climb out of it."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise ValueError(f"home file path must be relative and stay under HOME: {relative!r}")
    return home.joinpath(*parts)


def write_files(home: Path, files: Mapping[str, str]) -> None:
    """Write ``files`` under ``home`` (owner-only: configs hold the session's API key)."""
    for relative, text in files.items():
        path = home_file_path(home, relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o600)


def remove_tree(path: Path) -> None:
    """``rm -rf path``, making read-only entries (Go's module cache, git packs) writable first."""
    def retry(function, failed: str, _exc: object) -> None:
        try:
            os.chmod(failed, stat.S_IRWXU)
            os.chmod(os.path.dirname(failed), stat.S_IRWXU)
            function(failed)
        except OSError:
            pass

    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, onerror=retry)


def setup_failure(command: str, result: CommandResult) -> RuntimeInitError:
    """The error for a set-up command that did not succeed: the command, its exit and its output tail."""
    why = "timed out" if result.timed_out else f"exited {result.exit_code}"
    output = (result.stdout + result.stderr)[-_SETUP_TAIL:].strip()
    return RuntimeInitError(f"set-up command {command!r} {why}: {output}")


class LocalHandle(RuntimeHandle):
    """One session's directory: ``root/workspace`` and ``root/home``."""

    def __init__(self, session_id: str, root: Path, base_commit: str, env: Mapping[str, str],
                 kill_grace_s: float) -> None:
        self.session_id = session_id
        self.root = root
        self.workspace = str(root / "workspace")
        self.home = str(root / "home")
        self.base_commit = base_commit
        self._env = dict(env)
        self._kill_grace_s = kill_grace_s

    def command_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """What a command sees: the runtime's env, then ``env``, then HOME; PATH from ``env`` or this process."""
        merged = {**self._env, **env, "HOME": self.home}
        merged.setdefault("PATH", os.environ.get("PATH", os.defpath))
        return merged

    async def write_home_files(self, files: Mapping[str, str]) -> None:
        await asyncio.to_thread(write_files, Path(self.home), files)

    async def run(self, argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float,
                  stdin: str | None = None) -> CommandResult:
        return await run_process_group(argv, cwd=Path(self.workspace), env=self.command_env(env),
                                       timeout_s=timeout_s, stdin=stdin, kill_grace_s=self._kill_grace_s)

    async def patch(self) -> str:
        return await workspace_patch(Path(self.workspace), self.base_commit)

    async def teardown(self) -> None:
        await asyncio.to_thread(remove_tree, self.root)


class LocalRuntime(Runtime):
    """Session directories under ``root`` on this machine."""

    kind = "local"

    def __init__(self, root: Path | None = None, *, kill_grace_s: float = 2.0) -> None:
        self.root = root or default_root()
        self.kill_grace_s = kill_grace_s

    async def init(self, session_id: str, spec: RuntimeSpec, *, timeout_s: float) -> LocalHandle:
        self.root.mkdir(parents=True, exist_ok=True)
        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in session_id)[:64]
        directory = Path(tempfile.mkdtemp(prefix=f"{safe_id}-", dir=self.root))
        (directory / "home").mkdir()
        try:
            async with asyncio.timeout(timeout_s):
                try:
                    base = await prepare_workspace(spec.repo, spec.base_commit, directory / "workspace")
                except GitError as exc:
                    raise RuntimeInitError(f"workspace from {spec.repo!r}: {exc}") from exc
                handle = LocalHandle(session_id, directory, base, spec.env, self.kill_grace_s)
                for command in spec.setup:
                    result = await handle.run(["sh", "-c", command], env={}, timeout_s=timeout_s)
                    if result.exit_code != 0:
                        raise setup_failure(command, result)
                return handle
        except TimeoutError as exc:
            await asyncio.to_thread(remove_tree, directory)
            raise RuntimeInitError(f"runtime init took longer than {timeout_s:g}s") from exc
        except BaseException:
            await asyncio.to_thread(remove_tree, directory)
            raise
