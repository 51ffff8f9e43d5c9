"""A session's workspace as git sees it: checked out at the base commit, and its final patch.

Both runtimes prepare the workspace on this machine with these helpers (the docker runtime then
bind-mounts it), so the base commit and the patch are computed the same way everywhere:

- ``prepare_workspace``: a git repository (path or URL) is cloned and checked out at the base commit
  (HEAD when none is given); a plain directory that is not a repository (``examples/`` ships tiny task
  repositories that way) is copied and committed as the base; no repository gives an empty base commit.
- ``workspace_patch``: ``git add -A`` into a temporary index (``GIT_INDEX_FILE``: the harness's own index
  and commits are left alone), diffed against the base commit with ``--binary``. Harness config, caches and
  build output (``PATCH_EXCLUDES``) are left out; the result applies with ``git apply`` to a fresh
  checkout of the base commit.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from producers.errors import GitError as GitError

# Paths never part of a session's patch: what harnesses write into a workspace (config, sessions),
# language caches, virtual environments and build output. Globs as git pathspecs (``**/`` matches the
# workspace root as well); ``.git`` is never added by git itself.
PATCH_EXCLUDES: tuple[str, ...] = (
    "**/.codex/**", "**/.claude/**", "**/.qwen/**", "**/.pi/**", "**/.gemini/**",
    "**/node_modules/**", "**/__pycache__/**", "**/.pytest_cache/**", "**/*.pyc", "**/.venv/**",
    "**/build/**", "**/dist/**",
)

# A fixed identity for the commits rollwire makes, so that the host's git config does not matter.
_IDENTITY = ("-c", "user.name=rollwire", "-c", "user.email=rollwire@localhost", "-c", "commit.gpgsign=false")
_OUTPUT_TAIL = 4000


async def git(args: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
              check: bool = True) -> str:
    """Run ``git ARGS`` and return its stdout (raises :class:`GitError` on a non-zero exit when ``check``)."""
    full_env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", **(env or {})}
    process = await asyncio.create_subprocess_exec(
        "git", *args, cwd=cwd, env=full_env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await process.communicate()
    except BaseException:
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    if check and process.returncode != 0:
        output = (stderr or stdout).decode(errors="replace")[-_OUTPUT_TAIL:]
        raise GitError(f"git {' '.join(args)} exited {process.returncode}: {output.strip()}")
    return stdout.decode(errors="replace")


def _is_git_repository(path: Path) -> bool:
    """True for a work tree's top level or a bare repository (not a plain directory inside some repo)."""
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


async def prepare_workspace(repo: str | None, base_commit: str | None, workspace: Path) -> str:
    """Fill the (absent or empty) ``workspace`` from ``repo`` at ``base_commit``; return the base commit id."""
    source = Path(repo).expanduser() if repo else None
    if repo is None:
        workspace.mkdir(parents=True, exist_ok=True)
        return await _commit_all(workspace, "rollwire: empty workspace")
    if source is not None and source.is_dir() and not _is_git_repository(source):
        if base_commit:
            raise GitError(f"base_commit {base_commit!r} given but {repo} is not a git repository")
        await asyncio.to_thread(shutil.copytree, source, workspace, symlinks=True, dirs_exist_ok=True)
        return await _commit_all(workspace, f"rollwire: base of {source.name}")
    url = str(source.resolve()) if source is not None and source.exists() else repo
    await git(["clone", "--quiet", "--no-checkout", url, str(workspace)])
    await git(["checkout", "--quiet", "--detach", base_commit or "HEAD"], cwd=workspace)
    return (await git(["rev-parse", "HEAD"], cwd=workspace)).strip()


async def _commit_all(workspace: Path, message: str) -> str:
    await git(["init", "--quiet"], cwd=workspace)
    await git(["add", "-A", "--force", "."], cwd=workspace)
    await git([*_IDENTITY, "commit", "--quiet", "--allow-empty", "--no-verify", "-m", message], cwd=workspace)
    return (await git(["rev-parse", "HEAD"], cwd=workspace)).strip()


def exclude_pathspecs(excludes: Sequence[str] = PATCH_EXCLUDES) -> list[str]:
    """``excludes`` as git pathspecs that leave them out of ``git add``."""
    return [f":(exclude,glob){pattern}" for pattern in excludes]


async def workspace_patch(workspace: Path, base_commit: str, *, excludes: Sequence[str] = PATCH_EXCLUDES) -> str:
    """The workspace's changes against ``base_commit`` (new, modified, deleted, binary files), as
    ``git apply`` takes them, without the paths in ``excludes``."""
    with tempfile.TemporaryDirectory(prefix="rollwire-index-") as scratch:
        # Start from the base tree, so that files tracked there stay tracked even where a .gitignore
        # matches them (an empty index would show them as deleted), then take the work tree in.
        env = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        await git(["read-tree", base_commit], cwd=workspace, env=env)
        await git(["add", "-A", "--", ".", *exclude_pathspecs(excludes)], cwd=workspace, env=env)
        return await git(["diff", "--cached", "--binary", "--full-index", "--no-color", "--no-ext-diff",
                          "--no-textconv", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/", base_commit],
                         cwd=workspace, env=env)
