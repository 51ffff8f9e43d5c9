"""The prefix-merging builder: a session's calls as a tree of branches, one trace per branch.

Each usable call is a *turn* whose full sequence is its prompt followed by its sampled ids. A call's
*parent* is the earlier turn with the longest full sequence that its prompt extends by token prefix (the
tokens themselves, never text). Turns that extend one another form a branch; the branch's trace is the
last turn's full sequence with mask 1 on every sampled span and mask 0 on everything between them (tool
results, template glue, whatever the template appends after a ``length``-cut turn).

- A call whose parent is the tip of a branch continues that branch (``stats.merged``).
- A call whose parent is an earlier checkpoint (its turn was already continued: history rewritten after
  that point, a sub-agent forked from it) opens a branch with ``parent_branch`` set. Its prompt is all
  mask 0, so every sampled token is trained exactly once across the session's traces.
- A call that extends no turn opens a root branch (compaction, sub-agents, title generation, memory
  extraction). Interleaved agents thus keep separate branches.
- Branch roles: a call whose ``continuation.role`` (main, sub_agent, side) differs from its parent's
  does not continue the parent's branch even when its prompt extends the tip: it opens a branch with
  ``parent_branch`` set, so a side call made on the agent's context never lands in the agent's row. A
  trace's ``role`` is its first call's with a continuation block ("main" for older events).
- Retries: a call marked as a retry of an earlier usable turn with the same parent (``retry_of``, else
  the proxy's ``continuation.retry_of_sequence``), or whose prompt is identical to such a turn's, is
  another attempt at that turn. ``stats.retries`` counts these calls and every call marked as a retry
  (a retry of a failed call, or a mark the tokens contradict: reported). Of the attempts, the one the
  harness continued is kept; when none was continued (the session ended there), the **latest** is kept;
  the others are abandoned: dropped, not forked, listed in ``stats.abandoned`` and each named in
  ``stats.problems`` with the attempt kept. If several attempts were each continued they are evidently
  separate agents: all are kept as branches and a problem is reported.
- Failed calls are rejected (``stats.rejected``) before any of this. Sampled tokens without a logprob
  are masked out (mask 1 always comes with a real logprob), counted in ``stats.missing_logprobs`` and
  named in ``stats.problems``. A trace is ``truncated`` when its last turn stopped at ``length``; its
  ``cut_turns`` lists every turn that did (a cut turn in the middle was continued past the cut, the
  close token the proxy added after it being context, mask 0).
- Ties (two turns of equal length whose identical sequences the prompt extends) are reported in
  ``stats.problems`` unless they are attempts at one turn; the earliest turn is chosen (the latest
  attempt for retries).

Cost: per call, one vectorized prefix comparison against the tip of each provisional chain, so a linear
session costs O(total prompt tokens), with no per-token Python loops.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from processors.builders.common import Call, SessionFacts, TraceArrays, prepare, trace_id, trajectory
from processors.builders.continuations import call_role, retry_mark
from schemas.completions import Completion
from schemas.tasks import BuilderName
from schemas.trajectories import Trajectory, TrajectoryStats

NAME: BuilderName = "prefix_merging"

_FIRST_CHUNK = 256


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading positions where ``a`` and ``b`` agree (vectorized, stops near the first mismatch)."""
    m = min(len(a), len(b))
    if m == 0 or a[0] != b[0]:  # most unrelated chains (other agents, side calls) end here
        return 0
    if a[m - 1] == b[m - 1] and np.array_equal(a[:m], b[:m]):  # the usual case: one extends the other
        return m
    start, step = 0, _FIRST_CHUNK
    while start < m:
        end = min(m, start + step)
        differ = a[start:end] != b[start:end]
        if differ.any():
            return start + int(differ.argmax())
        start, step = end, step * 4
    return m


@dataclass(slots=True, eq=False)
class _Turn:
    call: Call
    parent: _Turn | None
    children: list[_Turn] = field(default_factory=list)
    attempts: list[_Turn] | None = None  # shared by every attempt at the same turn (retries)
    kept: bool = True
    branch: int = -1

    @property
    def full_len(self) -> int:
        return self.call.full_len


@dataclass(slots=True, eq=False)
class _Chain:
    """A provisional run of nested turns (each a prefix of the next): the unit the prefix search scans."""

    turns: list[_Turn]
    full_lens: list[int]

    def deepest_prefix(self, prompt: np.ndarray) -> _Turn | None:
        """The longest turn of this chain whose full sequence ``prompt`` extends, if any."""
        tip = self.turns[-1].call
        lcp = common_prefix_len(prompt, tip.prompt)
        if lcp == len(tip.prompt):
            lcp += common_prefix_len(prompt[lcp:], tip.sampled)
        index = bisect_right(self.full_lens, lcp) - 1
        return self.turns[index] if index >= 0 else None


def _find_parent(prompt: np.ndarray, chains: list[_Chain], call: Call, stats: TrajectoryStats) -> _Turn | None:
    best: list[_Turn] = []
    for chain in chains:
        turn = chain.deepest_prefix(prompt)
        if turn is None:
            continue
        if not best or turn.full_len > best[0].full_len:
            best = [turn]
        elif turn.full_len == best[0].full_len:
            best.append(turn)
    if len(best) <= 1:
        return best[0] if best else None
    if all(t.attempts is not None and t.attempts is best[0].attempts for t in best):
        return max(best, key=lambda t: t.call.sequence)  # identical attempts at one turn: the latest
    chosen = min(best, key=lambda t: t.call.sequence)
    stats.problems.append(f"{call.name()} extends {len(best)} equally long turns (sequences "
                          f"{sorted(t.call.sequence for t in best)}); continued sequence {chosen.call.sequence}")
    return chosen


def _earlier_attempt(call: Call, siblings: list[_Turn], by_sequence: dict[int, _Turn],
                     stats: TrajectoryStats) -> _Turn | None:
    """The earlier turn ``call`` retries, if it is another attempt at a turn already taken."""
    retry_of = retry_mark(call.event)
    if retry_of is not None and retry_of in by_sequence:
        target = by_sequence[retry_of]
        if any(target is s for s in siblings):
            return target
        stats.problems.append(f"{call.name()} is marked as a retry of sequence {retry_of}, but its prompt "
                              f"does not take the same turn; placed by its tokens")
    for sibling in reversed(siblings):
        if len(sibling.call.prompt) == len(call.prompt) and np.array_equal(sibling.call.prompt, call.prompt):
            return sibling
    return None


def _grow_tree(calls: list[Call], stats: TrajectoryStats) -> list[_Turn]:
    """Place every call under its parent turn and group attempts at the same turn."""
    turns: list[_Turn] = []
    roots: list[_Turn] = []
    chains: list[_Chain] = []
    chain_of: dict[int, _Chain] = {}  # id(turn) -> its provisional chain
    by_sequence: dict[int, _Turn] = {}
    for call in calls:
        parent = _find_parent(call.prompt, chains, call, stats)
        turn = _Turn(call, parent)
        siblings = parent.children if parent is not None else roots
        earlier = _earlier_attempt(call, siblings, by_sequence, stats)
        if retry_mark(call.event) is not None or earlier is not None:
            stats.retries += 1
        if earlier is not None:
            if earlier.attempts is None:
                earlier.attempts = [earlier]
            earlier.attempts.append(turn)
            turn.attempts = earlier.attempts
        siblings.append(turn)
        parent_chain = chain_of.get(id(parent)) if parent is not None else None
        if parent_chain is not None and parent_chain.turns[-1] is parent:
            parent_chain.turns.append(turn)
            parent_chain.full_lens.append(turn.full_len)
            chain_of[id(turn)] = parent_chain
        else:
            chain = _Chain([turn], [turn.full_len])
            chains.append(chain)
            chain_of[id(turn)] = chain
        turns.append(turn)
        by_sequence.setdefault(call.sequence, turn)
    return turns


def _settle_retries(turns: list[_Turn], stats: TrajectoryStats) -> None:
    """Keep, of each turn's attempts, the continued one (else the latest); abandon the rest, each listed in
    ``stats.abandoned`` and named in ``stats.problems`` with the attempt kept."""
    settled: set[int] = set()
    for turn in turns:
        attempts = turn.attempts
        if attempts is None or id(attempts) in settled:
            continue
        settled.add(id(attempts))
        continued = [a for a in attempts if a.children]
        if len(continued) > 1:
            stats.problems.append(f"sequences {[a.call.sequence for a in attempts]} attempt the same turn but "
                                  f"{[a.call.sequence for a in continued]} were each continued; kept as branches")
        keep = continued or [attempts[-1]]
        kept = (f"sequence {keep[0].call.sequence} attempted the same turn and was kept" if len(keep) == 1 else
                f"sequences {', '.join(str(k.call.sequence) for k in keep)} attempted the same turn and were kept")
        for attempt in attempts:
            attempt.kept = any(attempt is k for k in keep)  # dropped attempts have no children
            if not attempt.kept:
                stats.abandoned.append(attempt.call.sequence)
                stats.problems.append(f"{attempt.call.name()} was abandoned: {kept}; its sample is dropped, "
                                      f"not trained on")
    stats.abandoned.sort()


def _continues(parent: _Turn, turn: _Turn) -> bool:
    """Whether ``turn`` may extend its parent's branch: not when both carry a role and the roles differ."""
    parent_role, role = call_role(parent.call.event), call_role(turn.call.event)
    return parent_role is None or role is None or parent_role == role


def build(completions: Iterable[Completion], facts: SessionFacts) -> Trajectory:
    """Merge a session's completions into one trace per branch (see the module docstring for the rules)."""
    session = prepare(completions, facts)
    stats = session.stats
    turns = _grow_tree(session.calls, stats)
    _settle_retries(turns, stats)

    branches: list[list[_Turn]] = []
    parents: list[int | None] = []
    for turn in turns:
        if not turn.kept:
            continue
        parent = turn.parent
        if parent is not None and branches[parent.branch][-1] is parent and _continues(parent, turn):
            turn.branch = parent.branch
            branches[turn.branch].append(turn)
            stats.merged += 1
        else:
            turn.branch = len(branches)
            branches.append([turn])
            parents.append(parent.branch if parent is not None else None)
    stats.branches = len(branches)

    traces = []
    for number, (branch, parent_branch) in enumerate(zip(branches, parents, strict=True)):
        calls = [t.call for t in branch]
        arrays = TraceArrays(calls[-1], calls)
        for call in calls:
            arrays.sample(call, stats)
        traces.append(arrays.trace(trace_id=trace_id(facts.session_id, str(number)), branch=number,
                                   parent_branch=parent_branch, calls=calls))
    return trajectory(NAME, session, traces)
