"""Running one command on this machine as a process group: output tails, a timeout, cancellation.

The command starts in a new session (so in its own process group); at its timeout, on cancellation, and
after it exits (a harness can leave background children behind, holding its pipes) the whole group is
killed — SIGTERM, then SIGKILL after a grace period.

Nothing of a command outlives the process that started it (a gateway node), however that process ends
(SIGKILL included, where no cleanup code runs):

- the command's own process gets ``PR_SET_PDEATHSIG`` = SIGKILL (Linux): the kernel kills it when the
  thread that started it (the event loop's) exits;
- its children (a harness's tool commands, servers it started) are in its process group, which a
  :class:`GroupReaper` kills: a tiny helper process, started once per parent, that holds the read end of a
  pipe on which the parent registers each running group. The write end is only ever in the parent, so the
  helper reads end-of-file exactly when the parent is gone, and then kills every group still registered
  (SIGTERM, then SIGKILL after a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from producers.runtimes.base import CommandResult

OUTPUT_TAIL_BYTES = 256 * 1024
"""How much of each stream a CommandResult keeps (the end: a harness's result is its last output)."""

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
REAPER_GRACE_S = 1.0
"""After its parent is gone, how long the reaper waits between SIGTERM and SIGKILL of the groups."""

# The reaper: reads "+PGID" / "-PGID" lines; at end of input (its parent is gone) kills what is registered.
_REAPER_SCRIPT = f"""
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups = set()
for line in sys.stdin.buffer:
    try:
        op, pgid = line[:1], int(line[1:])
    except ValueError:
        continue
    if op == b"+":
        groups.add(pgid)
    elif op == b"-":
        groups.discard(pgid)
def signal_all(signum):
    alive = set()
    for pgid in groups:
        try:
            os.killpg(pgid, signum)
            alive.add(pgid)
        except OSError:
            pass
    return alive
if signal_all(signal.SIGTERM):
    time.sleep({REAPER_GRACE_S})
    signal_all(signal.SIGKILL)
"""


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child get SIGKILL when the calling thread (its parent) exits."""
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nothing would deliver the signal
            os._exit(1)

    return preexec


class GroupReaper:
    """Kills the registered process groups once this process is gone (see the module docstring).

    One per process (:func:`reaper`); started on first use, and again after a fork or if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._owner = 0
        self._groups: set[int] = set()

    def _ensure(self) -> subprocess.Popen[bytes] | None:
        process = self._process
        if process is not None and self._owner == os.getpid() and process.poll() is None:
            return process
        try:
            process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER_SCRIPT], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                       start_new_session=True)
        except OSError as exc:
            logger.warning("no process-group reaper (%s): commands may outlive this process if it is killed", exc)
            return None
        self._process, self._owner = process, os.getpid()
        for pgid in self._groups:  # a restarted reaper learns the groups still running
            self._write(process, f"+{pgid}\n")
        return process

    def _write(self, process: subprocess.Popen[bytes], line: str) -> bool:
        assert process.stdin is not None
        try:
            process.stdin.write(line.encode())
            process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return False
        return True

    def register(self, pgid: int) -> None:
        with self._lock:
            self._groups.add(pgid)
            process = self._ensure()
            if process is not None and not self._write(process, f"+{pgid}\n"):
                self._process = None
                self._ensure()

    def unregister(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)
            if self._process is not None and self._owner == os.getpid():
                self._write(self._process, f"-{pgid}\n")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None


_REAPER = GroupReaper()


def reaper() -> GroupReaper:
    """This process's reaper."""
    return _REAPER


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
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
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
        *argv, cwd=cwd, env=dict(env), start_new_session=True, preexec_fn=die_with_parent(),
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _REAPER.register(process.pid)
    try:
        return await _supervise(process, stdin=stdin, timeout_s=timeout_s, kill_grace_s=kill_grace_s,
                                output_limit=output_limit, started=started)
    finally:
        _REAPER.unregister(process.pid)


async def _supervise(process: asyncio.subprocess.Process, *, stdin: str | None, timeout_s: float,
                     kill_grace_s: float, output_limit: int, started: float) -> CommandResult:
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
