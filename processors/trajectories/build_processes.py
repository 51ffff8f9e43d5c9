"""Build processes: child processes that run session builds, spoken to over their stdin and stdout.

:class:`PooledBuilds` is the trajectory worker's :class:`~processors.trajectories.session_builds.SessionBuilds` when
``ROLLWIRE_PROCESSORS_BUILD_PROCESSES`` is above 0: each job (a session's record bytes and facts) is
written to one child as a frame, the child builds it (:func:`processors.trajectories.session_builds.build_session`)
and writes the result frame back; jobs to one child are answered in order. The event loop only writes
and reads pipes: no thread is involved. Written by hand rather than with ``concurrent.futures``'
process pool, which spends the worker's own CPU per completion in its feeder and manager threads,
contending with the event loop for the GIL (bench.pipeline measures the worker's CPU), and whose processes
outlived a worker killed outright. Here a child exits when its stdin closes, that is when its worker
is gone, however it went.

A frame is a 4-byte big-endian length and a pickle (protocol 5). The child announces itself with one
frame (``ready``) once it has imported the builders; it answers ``("ok", BuildResult)`` or
``("error", text)`` for every job.

    python -m processors.trajectories.build_processes      # a child: jobs on stdin, results on stdout
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
import sys
import traceback
from collections import deque
from typing import Any, BinaryIO

from processors.errors import BuildFailed, BuildProcessDied
from processors.trajectories.session_builds import (
    BuildJob,
    BuildResult,
    OnBuilt,
    OnFailed,
    SessionBuilds,
    build_session,
)

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
READY = "ready"


def _frame(value: Any) -> bytes:
    data = pickle.dumps(value, protocol=5)
    return _LENGTH.pack(len(data)) + data


class BuildProcess:
    """One child; :meth:`run` sends it a job and returns its result."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self._pending: deque[asyncio.Future[BuildResult]] = deque()
        self._reader: asyncio.Task[None] | None = None
        self.alive = False

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def start(self, timeout_s: float = 120.0) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "processors.trajectories.build_processes",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert self.process.stdout is not None
        try:
            ready = await asyncio.wait_for(self._read_frame(self.process.stdout), timeout_s)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            self.process.kill()
            raise BuildProcessDied(f"build process {self.process.pid} did not start: {exc!r}") from exc
        if ready != READY:
            self.process.kill()
            raise BuildProcessDied(f"build process {self.process.pid} said {ready!r} instead of {READY!r}")
        self.alive = True
        self._reader = asyncio.ensure_future(self._read_results())

    @staticmethod
    async def _read_frame(stream: asyncio.StreamReader) -> Any:
        (length,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
        return pickle.loads(await stream.readexactly(length))

    async def _read_results(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        try:
            while True:
                kind, value = await self._read_frame(self.process.stdout)
                future = self._pending.popleft()
                if future.done():
                    continue
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(BuildFailed(value))
        except (asyncio.IncompleteReadError, ConnectionError, pickle.UnpicklingError, IndexError) as exc:
            self._died(exc)

    def _died(self, exc: BaseException) -> None:
        self.alive = False
        pid = self.process.pid if self.process else None
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(BuildProcessDied(f"build process {pid} ended: {exc!r}"))

    async def run(self, job: BuildJob) -> BuildResult:
        if not self.alive or self.process is None or self.process.stdin is None:
            raise BuildProcessDied("build process is not running")
        future: asyncio.Future[BuildResult] = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        try:
            self.process.stdin.write(_frame(job))
            await self.process.stdin.drain()
        except (ConnectionError, RuntimeError) as exc:
            self._died(exc)
        return await future

    async def stop(self) -> None:
        self.alive = False
        if self._reader is not None:
            self._reader.cancel()
        self._died(RuntimeError("stopped"))
        if self.process is None or self.process.returncode is not None:
            return
        if self.process.stdin is not None:
            self.process.stdin.close()  # the child exits at the end of its input
        try:
            await asyncio.wait_for(self.process.wait(), 5)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()


class PooledBuilds(SessionBuilds):
    """Builds in ``processes`` build processes, each job to the one with the fewest jobs in hand, at most
    ``max_in_flight`` jobs at once (256 per process by default): past that, submit waits, which holds
    the stream back instead of queueing records' bytes without bound. The bound is high on purpose: an
    agent held at every session end (a bound of a few jobs per process) made Faust's flow control stop handing out
    records for seconds at a time in bench.pipeline's flood (the worker's catch-up read them back). A
    job holds its session's record bytes, which the payload cache held until then. A process that dies
    fails the jobs it held (their sessions are built again later) and is replaced at the next submit."""

    def __init__(self, processes: int, max_in_flight: int | None = None) -> None:
        self.processes: list[BuildProcess] = []
        self.size = processes
        self._room = asyncio.Semaphore(max_in_flight or 256 * processes)
        self._tasks: set[asyncio.Task[None]] = set()
        self._starting: asyncio.Lock | None = None
        self._closed = False

    async def start(self) -> None:
        """Start the missing processes and wait until they are ready (each imports the builders: about a
        second). Called at the worker's start, and again when a process has died."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            self.processes = [p for p in self.processes if p.alive]
            while len(self.processes) < self.size:
                process = BuildProcess()
                await process.start()
                self.processes.append(process)

    async def submit(self, job: BuildJob, on_built: OnBuilt, on_failed: OnFailed) -> None:
        if self._closed:
            raise RuntimeError("builds are closed")
        await self._room.acquire()
        try:
            if len(self.processes) < self.size or not all(p.alive for p in self.processes):
                await self.start()
            process = min(self.processes, key=lambda p: p.in_flight)
        except BaseException:
            self._room.release()
            raise
        task = asyncio.ensure_future(self._run(process, job, on_built, on_failed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, process: BuildProcess, job: BuildJob, on_built: OnBuilt, on_failed: OnFailed) -> None:
        try:
            try:
                result = await process.run(job)
            finally:
                self._room.release()
        except (BuildProcessDied, BuildFailed) as exc:
            logger.error("building session %s failed: %s", job.session_id, exc)
            await on_failed(job, exc)
            return
        try:
            await on_built(job, result)
        except Exception as exc:  # sending it failed: reported like a failed build, built again later
            logger.exception("sending the trajectory of %s failed", job.session_id)
            await on_failed(job, exc)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(p.stop() for p in self.processes), return_exceptions=True)
        self.processes = []


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    data = stream.read(n)
    if not data:
        return None
    while len(data) < n:
        more = stream.read(n - len(data))
        if not more:
            return None
        data += more
    return data


def serve(jobs: BinaryIO, results: BinaryIO) -> None:
    """The child's loop: a job frame in, a result frame out, until the input ends."""
    results.write(_frame(READY))
    results.flush()
    while True:
        head = _read_exactly(jobs, _LENGTH.size)
        if head is None:
            return
        body = _read_exactly(jobs, _LENGTH.unpack(head)[0])
        if body is None:
            return
        try:
            answer: tuple[str, Any] = ("ok", build_session(pickle.loads(body)))
        except Exception:
            answer = ("error", traceback.format_exc())
        results.write(_frame(answer))
        results.flush()


def main() -> None:
    # Results go to a private copy of stdout; anything else printed goes to stderr (the worker's log).
    results = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s build-process %(levelname)s %(name)s: %(message)s")
    serve(sys.stdin.buffer, results)


if __name__ == "__main__":
    main()
