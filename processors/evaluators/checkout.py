"""Applying a session's patch to a prepared workspace, and running a command with a timeout.

The workspace itself comes from producers.runtimes (the same checkout the session ran in: a repository
at its base commit, or a plain directory committed as the base). The patch is checked first
(``git apply --check``), so a refused patch changes nothing; git's reason is kept for the verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from processors.errors import ProcessorError

OUTPUT_TAIL_CHARS = 4000


class PatchDoesNotApply(ProcessorError):
    """``git apply`` refused the patch; the message is git's reason."""


@dataclass(frozen=True, slots=True)
class CommandOutcome:
    """A command's end: exit code (None when killed at its timeout) and the tail of its output."""

    exit_code: int | None
    output: str
    timed_out: bool
    duration_s: float


async def run_command(argv: Sequence[str], *, cwd: Path, timeout_s: float, env: Mapping[str, str] | None = None,
                      stdin: bytes | None = None) -> CommandOutcome:
    """Run ``argv`` in ``cwd`` (stdout and stderr together); kill its process group at ``timeout_s``."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env={**os.environ, **(env or {})}, start_new_session=True,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    timed_out = False
    output = b""
    try:
        output, _ = await asyncio.wait_for(process.communicate(stdin), timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        if process.returncode is None or timed_out:  # cancelled or timed out: the whole group goes
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await process.wait()
    text = output.decode(errors="replace")[-OUTPUT_TAIL_CHARS:]
    return CommandOutcome(None if timed_out else process.returncode, text, timed_out, time.monotonic() - started)


async def apply_patch(workspace: Path, patch: str, *, timeout_s: float = 120) -> None:
    """Apply ``patch`` to the work tree at ``workspace``; PatchDoesNotApply (nothing changed) if git refuses."""
    data = patch.encode() if patch.endswith("\n") else (patch + "\n").encode()
    env = {"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    for args in (["apply", "--check", "--whitespace=nowarn", "-"], ["apply", "--whitespace=nowarn", "-"]):
        outcome = await run_command(["git", *args], cwd=workspace, timeout_s=timeout_s, env=env, stdin=data)
        if outcome.exit_code != 0:
            raise PatchDoesNotApply(outcome.output.strip()[-2000:] or f"git apply exited {outcome.exit_code}")
