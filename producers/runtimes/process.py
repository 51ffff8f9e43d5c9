"""Running one command on this machine as a process group: output tails, a timeout, cancellation.

The command starts in a new session (so in its own process group); at its timeout, on cancellation, and
after it exits (a harness can leave background children behind, holding its pipes) the whole group is
killed — SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from producers.runtimes.base import CommandResult

OUTPUT_TAIL_BYTES = 256 * 1024
"""How much of each stream a CommandResult keeps (the end: a harness's result is its last output)."""


async def _read_tail(stream: asyncio.StreamReader, limit: int) -> bytes:
    tail = bytearray()
    while chunk := await stream.read(65536):
        tail += chunk
        if len(tail) > limit:
            del tail[:len(tail) - limit]
    return bytes(tail)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


async def _leader_exited(process: asyncio.subprocess.Process) -> None:
    """Return once the command's own process has exited.

    Not ``process.wait()``: asyncio waits for the pipes to close as well, which a background child the
    command left behind can postpone forever. A pidfd turns readable at the exit; where there is none
    (old kernels, the process already gone), the returncode the child watcher sets is polled."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        while process.returncode is None:
            await asyncio.sleep(0.05)
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _returncode(process: asyncio.subprocess.Process) -> int | None:
    """The exit status once the child watcher has reaped the process (moments after it exits)."""
    for _ in range(200):
        if process.returncode is not None:
            break
        await asyncio.sleep(0.05)
    return process.returncode


async def _kill_group(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the group, SIGKILL it once ``grace_s`` has passed or the leader is gone."""
    _signal_group(process.pid, signal.SIGTERM)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_leader_exited(process), grace_s)
    _signal_group(process.pid, signal.SIGKILL)
    await _leader_exited(process)


async def run_process_group(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout_s: float,
                            stdin: str | None = None, kill_grace_s: float = 2.0,
                            output_limit: int = OUTPUT_TAIL_BYTES) -> CommandResult:
    """Run ``argv`` in ``cwd`` with exactly ``env``; kill its process group at ``timeout_s`` or on cancellation."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=dict(env), start_new_session=True,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    readers = (asyncio.ensure_future(_read_tail(process.stdout, output_limit)),
               asyncio.ensure_future(_read_tail(process.stderr, output_limit)))
    timed_out = False
    try:
        if stdin is not None and process.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(stdin.encode())
                await process.stdin.drain()
            process.stdin.close()
        try:
            await asyncio.wait_for(_leader_exited(process), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await _kill_group(process, kill_grace_s)
        # Stragglers the command left in its group would keep the pipes open: the run is over for them too.
        _signal_group(process.pid, signal.SIGKILL)
        exit_code = await _returncode(process)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*readers), 10)
    except BaseException:
        # Cancelled (or failed) mid-run: nothing of the command may outlive the call.
        if process.returncode is None:
            await asyncio.shield(_kill_group(process, 0))
        _signal_group(process.pid, signal.SIGKILL)
        for reader in readers:
            reader.cancel()
        raise
    stdout, stderr = (r.result() if r.done() and not r.cancelled() else b"" for r in readers)
    for reader in readers:
        reader.cancel()
    return CommandResult(exit_code=None if timed_out else exit_code,
                         stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"),
                         timed_out=timed_out, duration_s=time.monotonic() - started)
