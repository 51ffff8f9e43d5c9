"""Building a session's trajectory from its stored completion records, and where that work runs.

A build is a pure function of the session's records and a few facts (:func:`build_session`): every
record validated in full, prompt deltas resolved along their chains (schemas.prompt_chain), the session's
builder run, the trajectory stamped and encoded. It is the trajectory worker's largest cost per session
and it touches no table, so the worker runs it off its event loop (:class:`PooledBuilds`: a process pool,
``ROLLWIRE_PROCESSORS_BUILD_PROCESSES``) while the loop goes on reading records; with no processes it runs
in place (:class:`InlineBuilds`, tests and small deployments). Jobs and results are plain picklable
values: record bytes in, record bytes out.

What a build finds wrong comes back as :class:`Rejected` calls (a record that fails validation, a delta
whose parent is missing): the worker dead-letters them with the record it still holds, and the
trajectory is built without them, its ``stats.problems`` naming each. Nothing in this module talks to
Kafka; a failed job (a crashed pool process) is reported to the caller, which builds the session again
later (the same inputs give the same trajectory event id).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from pydantic import ValidationError

from processors.builders import SessionFacts, UnknownBuilder, build_trajectory
from processors.open_sessions import CallRef
from schemas.codec import EventDecodeError, encode_record
from schemas.completions import Completion
from schemas.prompt_chain import MissingPromptParent, resolve_session

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BuildJob:
    """One session's build: its completion records in log order, its builder and facts."""

    session_id: str
    partition: int
    builder: str
    facts: SessionFacts
    calls: Sequence[tuple[CallRef, bytes]]
    source: str  # stamped on the trajectory (who wrote it)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A call left out of the trajectory, to be dead-lettered: where its record is and why."""

    ref: CallRef
    error_type: str
    reason: str


@dataclass(frozen=True, slots=True)
class TrajectoryRecord:
    """The trajectory as the Kafka record to send (encoded by schemas.codec.encode_record)."""

    session_id: str
    event_id: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
class BuildResult:
    trajectory: TrajectoryRecord
    rejected: list[Rejected] = field(default_factory=list)
    unresolved: int = 0  # of the rejected: deltas whose parent could not be had


def validate_completion(value: bytes, session_id: str) -> Completion:
    """Full validation of a stored completion record, when its session is built.

    The record passed only the envelope check at intake (:func:`~processors.intake.peek`), so everything
    is checked here: JSON, the model (pydantic parses the bytes itself: no intermediate dicts), and that
    it belongs to the session its key put it in.
    Raises EventDecodeError with the dead letter's error type, like decode_event.
    """
    try:
        event = Completion.model_validate_json(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise EventDecodeError("invalid_json", f"record value is not JSON: {first['msg']}") from exc
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise EventDecodeError("invalid_event", f"{exc.title} failed validation ({exc.error_count()} errors), "
                               f"first: {where}: {first['msg']}") from exc
    if event.session_id != session_id:
        raise EventDecodeError("key_mismatch", f"completion of session {event.session_id!r} was stored under "
                               f"session {session_id!r} (its record key)")
    return event


def build_session(job: BuildJob) -> BuildResult:
    """Validate, resolve and build the session of ``job``; pure (runs in a pool process or in place).

    A call whose prompt parent is not among the session's valid completions cannot be resolved: it is
    rejected (``missing_prompt_parent``), and so is every call further down its chain. The trajectory is
    built from the resolved calls only, the left-out ones named in ``stats.problems``: those calls are
    missing from it, like a completion lost to retention, but nothing in it is wrong (a missing parent
    never yields a guessed prompt).
    """
    rejected: list[Rejected] = []
    events: list[Completion] = []
    refs: dict[str, CallRef] = {}
    for ref, value in job.calls:
        try:
            event = validate_completion(value, job.session_id)
        except EventDecodeError as exc:
            # It passed the envelope check at intake; the full validation happens only now.
            rejected.append(Rejected(ref, exc.error_type, exc.reason))
            continue
        events.append(event)
        refs[event.event_id] = ref
    chain = resolve_session(events)
    problems: list[str] = []
    for item in chain.missing:
        event = item.completion
        rejected.append(Rejected(refs[event.event_id], MissingPromptParent.error_type, item.reason))
        problems.append(f"completion {event.event_id} (sequence {event.sequence}) left out and dead-lettered: "
                        f"{MissingPromptParent.error_type}: {item.reason}")
    try:
        trajectory = build_trajectory(job.builder, chain.resolved, job.facts)
    except (UnknownBuilder, ValueError) as exc:
        logger.exception("session %s: builder %s failed", job.session_id, job.builder)
        trajectory = build_trajectory("per_request", [], job.facts)
        trajectory.stats.problems.append(f"builder {job.builder} failed: {exc!r}")
    trajectory.stats.problems.extend(problems)
    record = encode_record(trajectory, job.source)
    return BuildResult(TrajectoryRecord(job.session_id, record.event.event_id, record.key, record.value,
                                        record.headers),
                       rejected, len(chain.missing))


# What a caller does with a finished build, and with one that failed (the session is built again later).
OnBuilt = Callable[[BuildJob, BuildResult], Awaitable[None]]
OnFailed = Callable[[BuildJob, BaseException], Awaitable[None]]


class SessionBuilds:
    """Where builds run. :meth:`submit` returns once the job is taken (it may wait for room);
    ``on_built`` or ``on_failed`` is awaited when the job is done."""

    async def submit(self, job: BuildJob, on_built: OnBuilt, on_failed: OnFailed) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Stop taking jobs; jobs still running are dropped (their sessions are built again later)."""


class InlineBuilds(SessionBuilds):
    """Builds on the caller's event loop, one at a time: ``on_built`` has run when submit returns."""

    async def submit(self, job: BuildJob, on_built: OnBuilt, on_failed: OnFailed) -> None:
        await on_built(job, build_session(job))


def _warm() -> None:
    """A job that does nothing: answered once a pool process has started and imported the builders."""


def _start_process() -> None:
    """Each pool process: exit when the worker that started it is gone. (A process of the pool waits for
    jobs on a pipe every process of the pool holds open, so a worker killed outright would otherwise
    leave its build processes behind.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="rollwire-build-parent", daemon=True).start()


class PooledBuilds(SessionBuilds):
    """Builds in ``processes`` worker processes (spawned: the worker's threads are not forked), at most
    ``max_in_flight`` jobs at once (taken or waiting in the pool): past that, submit waits, which holds
    the stream back instead of queueing records' bytes without bound."""

    def __init__(self, processes: int, max_in_flight: int | None = None) -> None:
        self.processes = processes
        self._room = asyncio.Semaphore(max_in_flight or 32 * processes)
        self._pool: Executor | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def _executor(self) -> Executor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_process)
        return self._pool

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the processes now and wait until they answer (a spawned process imports the builders:
        about a second), so that the first sessions to end do not wait for them."""
        pool = self._executor()
        for started in [pool.submit(_warm) for _ in range(self.processes)]:
            started.result(timeout_s)

    async def submit(self, job: BuildJob, on_built: OnBuilt, on_failed: OnFailed) -> None:
        if self._closed:
            raise RuntimeError("builds are closed")
        await self._room.acquire()
        try:
            pool = self._executor()
            future = asyncio.get_running_loop().run_in_executor(pool, build_session, job)
        except BaseException:
            self._room.release()
            raise
        task = asyncio.ensure_future(self._finish(job, pool, future, on_built, on_failed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, job: BuildJob, pool: Executor, future: asyncio.Future[BuildResult],
                      on_built: OnBuilt, on_failed: OnFailed) -> None:
        try:
            try:
                result = await future
            finally:
                self._room.release()
        except BrokenProcessPool as exc:
            logger.error("the build pool broke while building %s (%s); starting a new one", job.session_id, exc)
            if self._pool is pool:
                self._pool = None  # the next submit starts fresh processes
                pool.shutdown(wait=False, cancel_futures=True)
            await on_failed(job, exc)
            return
        except Exception as exc:  # a job that could not be pickled, or a bug: reported, retried later
            logger.exception("building %s failed", job.session_id)
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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
