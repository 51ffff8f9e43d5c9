"""What builders read from a completion's ``continuation`` block: branch roles and how prompts were built.

The proxy records on every completion how it built the prompt (an exact token continuation of a parent
call, or a full render of the chat template), the branch the call belongs to and that branch's role
(``main``, ``sub_agent``, ``side``), and how a full re-render would have differed (drift). Calls recorded
before the proxy built prompts itself carry no block: they have no known role (their trace is ``main``)
and count in none of the continuation statistics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from schemas.completions import BranchRole, Completion
from schemas.trajectories import Trace, TrajectoryStats

DEFAULT_ROLE: BranchRole = "main"
NO_DRIFT = "none"


def call_role(event: Completion) -> BranchRole | None:
    """The role the proxy gave the call's branch; None when the call carries no continuation block."""
    return event.continuation.role if event.continuation is not None else None


def retry_mark(event: Completion) -> int | None:
    """The sequence ``event`` says it retries: its ``retry_of``, else the proxy's
    ``continuation.retry_of_sequence`` (the parent's successor turn it re-asks, whose sample was abandoned)."""
    if event.retry_of is not None:
        return event.retry_of
    return event.continuation.retry_of_sequence if event.continuation is not None else None


def trace_role(events: Iterable[Completion]) -> BranchRole:
    """A trace's role: that of its first call with a continuation block, else ``main`` (older events)."""
    for event in events:
        role = call_role(event)
        if role is not None:
            return role
    return DEFAULT_ROLE


def cut_turns(events: Iterable[Completion]) -> list[int]:
    """Sequences of the calls whose sampled turn stopped at the length limit."""
    return [e.sequence for e in events if e.finish_reason == "length"]


def count_prompt_builds(events: Iterable[Completion], stats: TrajectoryStats) -> None:
    """Count exact continuations, drift kinds and proxy-closed cut turns over ``events``.

    ``stats.drift`` counts each kind once per call that shows it (a call may show several), and ``none``
    for an exact call whose re-render matched its prompt; a call said to differ without a kind counts as
    ``other``. These say how often a harness's history would break a merge done by re-rendering.
    """
    exact_calls = closed = 0
    drift: Counter[str] = Counter()
    for event in events:
        continuation = event.continuation
        if continuation is None:
            continue
        exact = continuation.mode == "exact"
        exact_calls += exact
        closed += continuation.closed_cut_turn
        if continuation.drift is None:
            continue
        if continuation.drift.differs:
            drift.update(set(continuation.drift.kinds) or {"other"})
        elif exact:
            drift[NO_DRIFT] += 1
    stats.exact_calls, stats.closed_cut_turns, stats.drift = exact_calls, closed, dict(sorted(drift.items()))


def settle_roles(traces: list[Trace], events: Iterable[Completion]) -> list[Trace]:
    """The traces with a late-known role fixed: a ``main`` trace none of whose calls offered tools is a
    ``side`` one when another ``main`` trace offers tools. The proxy labels each call as it comes, and a
    harness's side call made before its agent's first call (opencode asks for the session's title first)
    opened the session as its ``main`` line; by the session's end it is plain which line is the agent's."""
    offers_tools = {event.event_id: bool(event.request.tools) for event in events}

    def tooled(trace: Trace) -> bool:
        return any(offers_tools.get(completion_id, False) for completion_id in trace.completion_ids)

    if not any(trace.role == "main" and tooled(trace) for trace in traces):
        return traces
    return [trace.model_copy(update={"role": "side"}) if trace.role == "main" and not tooled(trace) else trace
            for trace in traces]


def count_traces(traces: Iterable[Trace], stats: TrajectoryStats) -> None:
    """Count traces per role and cut turns over all traces."""
    roles: Counter[str] = Counter()
    cut = 0
    for trace in traces:
        roles[trace.role] += 1
        cut += len(trace.cut_turns)
    stats.roles, stats.cut_turns = dict(sorted(roles.items())), cut
