"""What every trajectory builder shares: session facts, input cleaning, trace assembly.

Builders are pure functions of a session's completion events and a few facts about the session: the
same input, in any order and with any duplicates, gives the same trajectory (same trace ids, same event
id), so a rebuild from the log or a worker restarted after a crash re-emits identical events that
consumers de-duplicate on ``event_id``.

Policy versions: a trajectory's ``policy_versions`` is the range of engine weight versions over the
completions its traces hold: each one's ``policy_version`` and the versions of its ``weight_versions``
spans (a call that straddled a weight update), read with :func:`schemas.policy.version_number`; None when
none of them is a version number (labels such as ``step-3``, or events recorded before the proxy filled
it). The session's claimed ``policy_version`` string is kept apart, as it was.

Builders take full prompts only: a completion that is still a prompt delta (schema version 2,
``prompt_delta`` set) is refused with :class:`UnresolvedPromptDelta`, never built from its new tokens alone.
Callers resolve a session's completions with :func:`schemas.prompt_chain.resolve_session` first (and
dead-letter or count the ones whose parent is missing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from processors.builders.continuations import count_prompt_builds, count_traces, cut_turns, settle_roles, trace_role
from processors.errors import UnresolvedPromptDelta
from schemas.arrays import Logprobs, LossMask, TokenIds
from schemas.completions import Completion
from schemas.envelope import utcnow
from schemas.policy import PolicyRange, version_number
from schemas.prompt_chain import is_delta
from schemas.sessions import FailureKind, SessionStatus
from schemas.tasks import BuilderName
from schemas.trajectories import Trace, Trajectory, TrajectoryStats


@dataclass(frozen=True, slots=True)
class SessionFacts:
    """What the builder is told about the session besides its completions."""

    session_id: str
    task_id: str | None = None
    policy_version: str | None = None
    status: SessionStatus | None = None
    failure: FailureKind | None = None
    partial: bool = False
    ended_at: datetime | None = None  # stamps the trajectory; defaults to the latest completion's time


Builder = Callable[[Iterable[Completion], SessionFacts], Trajectory]


@dataclass(slots=True, eq=False)
class Call:
    """A usable completion reduced to read-only numpy views of its tokens (no copies)."""

    event: Completion
    prompt: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray | None  # None: the engine returned no logprobs at all

    @property
    def sequence(self) -> int:
        return self.event.sequence

    @property
    def event_id(self) -> str:
        return self.event.event_id

    @property
    def full_len(self) -> int:
        return len(self.prompt) + len(self.sampled)

    def name(self) -> str:
        return f"completion {self.event_id} (sequence {self.sequence})"


@dataclass(slots=True)
class Session:
    """A session's completions after cleaning: usable calls in sequence order, plus the bookkeeping."""

    facts: SessionFacts
    events: list[Completion]  # every distinct event, sorted by (sequence, event_id)
    calls: list[Call]  # the usable ones (status ok, with token ids)
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)


def prepare(completions: Iterable[Completion], facts: SessionFacts) -> Session:
    """Sort by sequence, drop re-delivered events (same event id), reject failed or token-less calls."""
    stats = TrajectoryStats()
    ordered = sorted(completions, key=lambda c: (c.sequence, c.event_id))
    events: list[Completion] = []
    seen: set[str] = set()
    for event in ordered:
        if is_delta(event):
            assert event.prompt_delta is not None
            raise UnresolvedPromptDelta(
                f"completion {event.event_id} (sequence {event.sequence}) of session {event.session_id!r} is a "
                f"prompt delta against {event.prompt_delta.parent_event_id}: resolve the session with "
                "schemas.prompt_chain.resolve_session before building (a delta's prompt alone is not its prompt)")
        if event.event_id not in seen:
            seen.add(event.event_id)
            events.append(event)
    stats.completions = len(events)
    calls: list[Call] = []
    previous: Completion | None = None
    for event in events:
        if previous is not None and previous.sequence == event.sequence:
            stats.problems.append(f"sequence {event.sequence} is carried by two events ({previous.event_id}, "
                                  f"{event.event_id}); both kept, ordered by event id")
        previous = event
        if event.session_id != facts.session_id:
            stats.rejected += 1
            stats.problems.append(f"completion {event.event_id} (sequence {event.sequence}) belongs to "
                                  f"session {event.session_id!r}, not {facts.session_id!r}; skipped")
            continue
        if event.status != "ok":
            stats.rejected += 1  # failed calls are never trained on
            continue
        if event.prompt_token_ids is None or event.token_ids is None:
            stats.rejected += 1
            stats.problems.append(f"completion {event.event_id} (sequence {event.sequence}) has no token ids "
                                  f"(capture failed?); skipped, never re-tokenized from text")
            continue
        logprobs = event.logprobs.numpy if event.logprobs is not None else None
        calls.append(Call(event, event.prompt_token_ids.numpy, event.token_ids.numpy, logprobs))
    return Session(facts, events, calls, stats)


class TraceArrays:
    """One trace's token, mask and logprob arrays, filled span by span (vectorized, no token loops)."""

    __slots__ = ("tokens", "mask", "logprobs")

    def __init__(self, last: Call, calls: Iterable[Call]) -> None:
        # Every call of a trace is a prefix of its last call's full sequence, so that one sequence is the
        # trace's tokens; the calls only say where the sampled (trainable) spans lie.
        self.tokens = np.concatenate([last.prompt, last.sampled]).astype(np.int32, copy=False)
        n = len(self.tokens)
        self.mask = np.zeros(n, dtype=np.uint8)
        wide = any(c.logprobs is not None and c.logprobs.dtype == np.float64 for c in calls)
        self.logprobs = np.full(n, np.nan, dtype=np.float64 if wide else np.float32)

    def sample(self, call: Call, stats: TrajectoryStats) -> None:
        """Mark ``call``'s sampled span trainable where it has a logprob; report tokens without one."""
        start, count = len(call.prompt), len(call.sampled)
        if count == 0:
            return
        if call.logprobs is None:
            missing = count
        else:
            present = ~np.isnan(call.logprobs)
            self.mask[start:start + count] = present
            self.logprobs[start:start + count] = call.logprobs
            missing = count - int(present.sum())
        if missing:
            # Masked out rather than trained with a made-up value: mask 1 always comes with a real logprob.
            stats.missing_logprobs += missing
            stats.problems.append(f"{call.name()}: {missing} of {count} sampled tokens have no logprob; "
                                  f"they are masked out (loss mask 0)")

    def trace(self, *, trace_id: str, branch: int, parent_branch: int | None, calls: list[Call]) -> Trace:
        return Trace(trace_id=trace_id, branch=branch, parent_branch=parent_branch,
                     completion_ids=[c.event_id for c in calls], sequences=[c.sequence for c in calls],
                     token_ids=TokenIds(self.tokens), loss_mask=LossMask(self.mask), logprobs=Logprobs(self.logprobs),
                     truncated=calls[-1].event.finish_reason == "length",
                     cut_turns=cut_turns(c.event for c in calls), role=trace_role(c.event for c in calls))


def trace_id(session_id: str, label: str) -> str:
    """A trace id derived from the session and the trace's place in it (never random)."""
    return f"{session_id}/{label}"


def _common(values: Iterable[str | None], what: str, stats: TrajectoryStats) -> str | None:
    distinct = sorted({v for v in values if v is not None})
    if len(distinct) > 1:
        stats.problems.append(f"completions carry different {what}s: {', '.join(distinct)}")
    return distinct[-1] if distinct else None


def completion_versions(event: Completion, problems: list[str] | None = None) -> list[int]:
    """The weight versions one completion's tokens were sampled under: its ``policy_version`` and every
    ``weight_versions`` span's version that is a version number; a span without one is named in
    ``problems`` (when given) and passed over."""
    versions: list[int] = []
    own = version_number(event.policy_version)
    if own is not None:
        versions.append(own)
    for span in event.weight_versions or ():
        number = version_number(_span_version(span))
        if number is not None:
            versions.append(number)
        elif problems is not None:
            problems.append(f"completion {event.event_id} (sequence {event.sequence}): weight version span "
                            f"{span!r} has no version number; not counted in policy_versions")
    return versions


def _span_version(span: object) -> str | int | None:
    """A span's ``version`` if it is a string or an integer (JSON gives either), else None."""
    if not isinstance(span, dict):
        return None
    version = span.get("version")
    if isinstance(version, bool) or not isinstance(version, (str, int)):
        return None
    return version


def policy_range(events: Iterable[Completion], problems: list[str] | None = None) -> PolicyRange | None:
    """The oldest and newest weight version over these completions; None when none has a version number."""
    return PolicyRange.over([v for event in events for v in completion_versions(event, problems)])


def trajectory(builder: BuilderName, session: Session, traces: list[Trace]) -> Trajectory:
    """Wrap traces into the Trajectory event, with an event id derived from its inputs; completes the stats
    that every builder reports the same way (traces, truncation, roles, how the prompts were built)."""
    facts, stats = session.facts, session.stats
    traces = settle_roles(traces, (c.event for c in session.calls))
    stats.traces = len(traces)
    stats.truncated = sum(t.truncated for t in traces)
    count_traces(traces, stats)
    events = [c.event for c in session.calls]
    count_prompt_builds(events, stats)
    policy_version = facts.policy_version or _common((e.policy_version for e in events), "policy version", stats)
    task_id = facts.task_id or _common((e.task_id for e in events), "task id", stats)
    # Only what the traces hold: abandoned retries' tokens are not trained on, so their versions do not count.
    used = {completion_id for t in traces for completion_id in t.completion_ids}
    versions = policy_range((e for e in events if e.event_id in used), stats.problems)
    digest = hashlib.sha256("\0".join([builder, facts.session_id, str(facts.partial),
                                       *sorted(e.event_id for e in session.events)]).encode()).hexdigest()
    occurred_at = facts.ended_at or max((e.occurred_at for e in session.events), default=None) or utcnow()
    return Trajectory(event_id=digest[:32], occurred_at=occurred_at, session_id=facts.session_id,
                      task_id=task_id, builder=builder, policy_version=policy_version,
                      policy_versions=versions, session_status=facts.status, failure=facts.failure,
                      partial=facts.partial, traces=traces, stats=stats)
