"""The per-request builder: one trace per usable model call, the baseline prefix merging is measured against."""

from __future__ import annotations

from collections.abc import Iterable

from processors.builders.common import SessionFacts, TraceArrays, prepare, trace_id, trajectory
from processors.builders.continuations import retry_mark
from schemas.completions import Completion
from schemas.tasks import BuilderName
from schemas.trajectories import Trajectory

NAME: BuilderName = "per_request"


def build(completions: Iterable[Completion], facts: SessionFacts) -> Trajectory:
    """One trace per usable completion: its prompt (mask 0, logprob NaN), then its sampled ids (mask 1).

    Every attempt is its own row, retries included (``stats.retries`` counts the completions marked
    ``retry_of`` or ``continuation.retry_of_sequence``; none is abandoned); failed calls are rejected;
    sampled tokens without a logprob are masked out and reported. Trace ``i`` (in sequence order) has
    branch ``i`` and id ``<session>/r<i>``; its ``role`` and ``cut_turns`` are its call's, counted in the
    stats with the continuation figures as for every builder.
    """
    session = prepare(completions, facts)
    stats = session.stats
    stats.retries = sum(retry_mark(e) is not None for e in session.events)
    traces = []
    for index, call in enumerate(session.calls):
        arrays = TraceArrays(call, [call])
        arrays.sample(call, stats)
        traces.append(arrays.trace(trace_id=trace_id(facts.session_id, f"r{index}"), branch=index,
                                   parent_branch=None, calls=[call]))
    stats.branches = len(traces)
    return trajectory(NAME, session, traces)
