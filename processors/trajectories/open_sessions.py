"""Per-session state of the trajectory worker, as plain values: what is kept, when a session is due.

The Faust app (processors/trajectories/app.py) keeps, per open session, one small :class:`OpenSession` value: times,
the end facts, and the offsets of its completion records in the ``completions`` log (the bytes stay in
the log, see processors/trajectories/payloads.py). A session's records all sit on one partition (they are keyed by
session id), so an offset is all a completion needs: the value grows by a few bytes per call and never
holds a payload or a token array, and the worker writes it once per session per batch of records.
The spec's few fields the worker needs are kept apart (:class:`SpecFacts`), since a spec may arrive
before or after the session's first event. Everything here is pure and tested without Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

import orjson

from processors.builders import SessionFacts
from schemas.sessions import FailureKind, SessionEnded, SessionSpec, SessionStatus

DEFAULT_BUILDER = "prefix_merging"


@dataclass(frozen=True, slots=True)
class CallRef:
    """Where one completion record is: its partition and offset in the ``completions`` topic."""

    partition: int
    offset: int

    def dumps(self) -> bytes:
        return b"%d:%d" % (self.partition, self.offset)

    @classmethod
    def loads(cls, raw: bytes) -> CallRef:
        partition, _, offset = raw.partition(b":")
        return cls(int(partition), int(offset))

    def __reduce__(self) -> tuple[type[CallRef], tuple[int, int]]:
        # Pickled with every build job (processors.trajectories.build_processes): a slotted dataclass's default
        # state goes through dataclasses.fields() each time.
        return CallRef, (self.partition, self.offset)


@dataclass(frozen=True, slots=True)
class EndFacts:
    """The session.ended event, reduced to what the builder and the readiness check need."""

    status: str
    failure: str | None
    task_id: str | None
    occurred_at: str
    record_ts: float  # the end record's Kafka timestamp (the producer's clock: readiness does not use it)

    @classmethod
    def of(cls, event: SessionEnded, record_ts: float) -> EndFacts:
        return cls(event.status.value, event.failure.value if event.failure else None, event.task_id,
                   event.occurred_at.isoformat(), record_ts)


@dataclass(frozen=True, slots=True)
class SpecFacts:
    """The spec fields the worker uses; stored under the session id."""

    builder: str
    timeout_s: float
    task_id: str | None
    policy_version: str | None
    seen_at: float  # worker clock when the spec was read

    @classmethod
    def of(cls, spec: SessionSpec, now: float) -> SpecFacts:
        return cls(spec.builder, spec.timeout_s, spec.task_id, spec.policy_version, now)

    def dumps(self) -> bytes:
        return orjson.dumps(self)  # orjson writes a dataclass as its fields, in order

    @classmethod
    def loads(cls, raw: bytes) -> SpecFacts:
        return cls(**orjson.loads(raw))


@dataclass(frozen=True, slots=True)
class OpenSession:
    """A session that has had events and is not built yet."""

    partition: int
    offsets: tuple[int, ...] = ()  # its completion records in the completions log, in arrival order
    first_seen: float = 0.0
    last_seen: float = 0.0
    end: EndFacts | None = None

    def dumps(self) -> bytes:
        # orjson writes dataclasses (the end too) field by field, in order: dataclasses.asdict deep-copied
        # every value first, once per record of the session.
        return orjson.dumps(self)

    @classmethod
    def loads(cls, raw: bytes) -> OpenSession:
        data = orjson.loads(raw)
        end = data.pop("end")
        return cls(data["partition"], tuple(data["offsets"]), data["first_seen"], data["last_seen"],
                   EndFacts(**end) if end else None)

    @property
    def calls(self) -> list[CallRef]:
        """Its completion records, each once (a re-delivered record has the same offset), in log order."""
        return [CallRef(self.partition, offset) for offset in sorted(set(self.offsets))]

    def touched(self, now: float) -> OpenSession:
        return replace(self, last_seen=max(self.last_seen, now))

    def with_call(self, offset: int, now: float) -> OpenSession:
        if offset in self.offsets:  # re-delivered (a replay after a restart)
            return self.touched(now)
        return replace(self, offsets=(*self.offsets, offset), last_seen=max(self.last_seen, now))

    def ended(self, end: EndFacts, now: float) -> OpenSession:
        return replace(self, end=end, last_seen=max(self.last_seen, now))


def deadline(session: OpenSession, spec: SpecFacts | None, *, idle_s: float, grace_s: float,
             active_since: float) -> float:
    """When an unended session is built as partial (worker clock).

    A session with a spec: its ``timeout_s`` (plus ``grace_s``, for the gateway's own timeout event to
    arrive) after it was first seen, however long it was quiet meanwhile. A harness may well make no call
    for longer than ``idle_s`` (a test suite or a build that runs for a quarter of an hour), and a session
    built at its idle deadline lost every call made after it (late, and dropped); the spec's timeout is
    what the gateway enforces, and it ends every session it runs by then. A session with no spec (its
    calls' ids alone): ``idle_s`` after its last event. Never earlier than ``grace_s`` after this worker
    became active, so that after a restart the log is replayed before anything is declared abandoned (the
    stored times are from before the crash).
    """
    if spec is not None:
        due = min(spec.seen_at, session.first_seen) + spec.timeout_s + grace_s
    else:
        due = session.last_seen + idle_s
    return max(due, active_since + grace_s)


def facts(session_id: str, session: OpenSession | None, spec: SpecFacts | None, *, partial: bool) -> SessionFacts:
    """What the builder is told about the session."""
    end = session.end if session is not None and not partial else None
    task_id = (spec.task_id if spec else None) or (end.task_id if end else None)
    return SessionFacts(
        session_id=session_id, task_id=task_id, policy_version=spec.policy_version if spec else None,
        status=SessionStatus(end.status) if end else None,
        failure=FailureKind(end.failure) if end and end.failure else None,
        partial=partial, ended_at=datetime.fromisoformat(end.occurred_at) if end else None)


def builder_name(spec: SpecFacts | None) -> str:
    """The session's builder: the spec's, or prefix_merging when no spec was seen."""
    return spec.builder if spec is not None else DEFAULT_BUILDER
