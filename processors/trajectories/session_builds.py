"""Building a session's trajectory from its stored completion records, and where that work runs.

A build is a pure function of the session's records and a few facts (:func:`build_session`): every
record validated in full, prompt deltas resolved along their chains (schemas.prompt_chain), the session's
builder run, the trajectory stamped and encoded. It is the trajectory worker's largest cost per session
and it touches no table, so the worker can run it off its event loop (processors.trajectories.build_processes:
``ROLLWIRE_PROCESSORS_BUILD_PROCESSES`` child processes) while the loop goes on reading records; with no
processes it runs in place (:class:`InlineBuilds`). Jobs and results are plain picklable values: record
bytes in, record bytes out.

What a build finds wrong comes back as :class:`Rejected` calls (a record that fails validation, a delta
whose parent is missing): the worker dead-letters them with the record it still holds, and the
trajectory is built without them, its ``stats.problems`` naming each. Nothing in this module talks to
Kafka; a failed job (a build process that died) is reported to the caller, which builds the session
again later (the same inputs give the same trajectory event id).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from processors.builders import SessionFacts, UnknownBuilder, build_trajectory
from processors.trajectories.open_sessions import CallRef
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

    The record passed only the envelope check at intake (:func:`~processors.trajectories.intake.peek`), so everything
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
