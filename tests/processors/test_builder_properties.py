"""Property tests: builders over generated sessions (linear chains, forks, side calls, retries, failures).

Every generated token is fresh (a global counter), so no two turns share tokens by accident: the only
prefix relations are the ones the generated harness meant. The generator also knows which attempt of each
turn the harness used, hence exactly which sampled tokens must be trained on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processors.builders import SessionFacts, build_trajectory
from schemas.arrays import Logprobs
from schemas.completions import Completion
from schemas.trajectories import Trajectory
from tests.processors.factory import SESSION, full, logprob_of, make_call

FACTS = SessionFacts(session_id=SESSION)
ACTIONS = ["continue"] * 4 + ["side_call", "fork", "retry", "fail_then_retry"]


@dataclass
class _Agent:
    context: list[int]
    checkpoints: list[list[int]] = field(default_factory=list)
    last: Completion | None = None
    tip_forked: bool = False  # a sub-agent started from the current tip: a retry would be ambiguous


@dataclass
class GeneratedSession:
    events: list[Completion]
    trained: list[int]  # sampled tokens of the attempts the harness used: each must be trained exactly once
    used_ids: set[str]  # event ids of those attempts
    linear: bool


class _Harness:
    def __init__(self) -> None:
        self.next_token = 1
        self.events: list[Completion] = []
        self.used: dict[str, Completion] = {}  # event id -> attempts the harness used
        self.agents: list[_Agent] = []

    def fresh(self, n: int) -> list[int]:
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return tokens

    def call(self, agent: _Agent, prompt: list[int], sampled_n: int, **kwargs) -> Completion:
        event = make_call(len(self.events), prompt, self.fresh(sampled_n), **kwargs)
        self.events.append(event)
        if event.status == "ok":
            self.used[event.event_id] = event
            agent.last, agent.context, agent.tip_forked = event, full(event), False
            agent.checkpoints.append(full(event))
        return event

    def replace_last(self, agent: _Agent, retry: Completion) -> None:
        """The harness uses the retry's answer instead of the previous attempt's."""
        assert agent.last is not None
        del self.used[agent.last.event_id]
        agent.checkpoints.pop()
        self.used[retry.event_id] = retry
        agent.last, agent.context = retry, full(retry)
        agent.checkpoints[-1] = full(retry)


@st.composite
def sessions(draw: st.DrawFn, actions: list[str] | None = None) -> GeneratedSession:
    harness = _Harness()
    root = _Agent(context=harness.fresh(draw(st.integers(1, 5))))
    harness.agents.append(root)
    harness.call(root, root.context, draw(st.integers(0, 4)))
    steps = draw(st.lists(st.tuples(st.sampled_from(actions or ACTIONS), st.integers(0, 99), st.integers(0, 99),
                                    st.integers(0, 4), st.integers(0, 4), st.booleans()), max_size=14))
    linear = True
    for action, which, point, glue, sampled_n, mark in steps:
        agent = harness.agents[which % len(harness.agents)]
        if action in ("retry", "fail_then_retry") and (agent.tip_forked or agent.last is None):
            action = "continue"
        linear = linear and action == "continue"
        if action == "continue":
            harness.call(agent, agent.context + harness.fresh(glue), sampled_n)
        elif action == "side_call":
            side = _Agent(context=harness.fresh(glue + 1))
            harness.agents.append(side)
            harness.call(side, side.context, sampled_n)
        elif action == "fork":  # history rewritten after a checkpoint, or a sub-agent started from one
            base_index = point % len(agent.checkpoints)
            if base_index == len(agent.checkpoints) - 1:
                agent.tip_forked = True
            forked = _Agent(context=agent.checkpoints[base_index] + harness.fresh(glue + 1))
            harness.agents.append(forked)
            harness.call(forked, forked.context, sampled_n)
        elif action == "retry":
            previous = agent.last
            prompt = previous.prompt_token_ids.tolist()
            retry = make_call(len(harness.events), prompt, harness.fresh(sampled_n),
                              retry_of=previous.sequence if mark else None)
            harness.events.append(retry)
            agent.checkpoints.append([])  # placeholder popped by replace_last
            harness.replace_last(agent, retry)
        else:  # the engine fails; the proxy (or harness) retries the same prompt
            prompt = agent.context + harness.fresh(glue)
            failed = make_call(len(harness.events), prompt, [], status="error")
            harness.events.append(failed)
            harness.call(agent, prompt, sampled_n, retry_of=failed.sequence if mark else None)
    trained = [t for event in harness.used.values() for t in event.token_ids.tolist()]
    return GeneratedSession(harness.events, trained, set(harness.used), linear)


def _trained_tokens(result: Trajectory) -> list[int]:
    return [t for trace in result.traces for t in trace.token_ids.numpy[trace.loss_mask.numpy == 1].tolist()]


def _check_traces_are_well_formed(result: Trajectory, events: list[Completion]) -> None:
    by_id = {e.event_id: e for e in events}
    for number, trace in enumerate(result.traces):
        n = len(trace.token_ids)
        mask, logprobs = trace.loss_mask.numpy, trace.logprobs.numpy
        assert len(mask) == n and len(logprobs) == n
        assert np.isnan(logprobs[mask == 0]).all()
        assert trace.logprobs.numpy[mask == 1].tolist() == [
            logprob_of(t) for t in trace.token_ids.numpy[mask == 1].tolist()]
        assert trace.branch == number
        assert trace.parent_branch is None or trace.parent_branch < number
        for event_id in trace.completion_ids:  # every merged call is a prefix of its trace
            call = full(by_id[event_id])
            assert trace.token_ids.tolist()[:len(call)] == call


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions(), st.data())
def test_prefix_merging_trains_every_used_sampled_token_exactly_once(session: GeneratedSession,
                                                                     data: st.DataObject) -> None:
    result = build_trajectory("prefix_merging", session.events, FACTS)
    assert Counter(_trained_tokens(result)) == Counter(session.trained)
    assert max(Counter(_trained_tokens(result)).values(), default=1) == 1
    _check_traces_are_well_formed(result, session.events)
    merged_ids = [i for trace in result.traces for i in trace.completion_ids]
    assert len(merged_ids) == len(set(merged_ids))
    assert result.stats.branches == result.stats.traces == len(result.traces)
    assert result.stats.missing_logprobs == 0
    # Every usable call is in a trace or abandoned, each abandoned one named in a problem; with distinct
    # samples (no two empty turns alike), the abandoned are exactly the attempts the harness replaced.
    ok = [e for e in session.events if e.status == "ok"]
    traced = {s for trace in result.traces for s in trace.sequences}
    assert result.stats.abandoned == sorted(e.sequence for e in ok if e.sequence not in traced)
    assert all(any(f"(sequence {s}) was abandoned" in p for p in result.stats.problems)
               for s in result.stats.abandoned)
    if all(len(e.token_ids) for e in ok):
        assert result.stats.abandoned == sorted(e.sequence for e in ok if e.event_id not in session.used_ids)
    # Any delivery order, with redeliveries, builds the same trajectory.
    redelivered = data.draw(st.lists(st.sampled_from(session.events), max_size=4))
    shuffled = data.draw(st.permutations(session.events + redelivered))
    assert build_trajectory("prefix_merging", shuffled, FACTS) == result


@settings(max_examples=150, deadline=None)
@given(sessions(actions=["continue"]))
def test_linear_session_is_one_row_of_the_last_prompt_and_its_sampled_tokens(session: GeneratedSession) -> None:
    assert session.linear
    result = build_trajectory("prefix_merging", session.events, FACTS)
    (trace,) = result.traces
    assert trace.token_ids.tolist() == full(session.events[-1])
    assert trace.sequences == list(range(len(session.events)))
    assert result.stats.merged == len(session.events) - 1
    assert result.stats.problems == []


@settings(max_examples=150, deadline=None)
@given(sessions())
def test_per_request_rows_are_the_usable_completions(session: GeneratedSession) -> None:
    result = build_trajectory("per_request", session.events, FACTS)
    usable = [e for e in session.events if e.status == "ok"]
    assert [t.completion_ids for t in result.traces] == [[e.event_id] for e in usable]
    assert result.stats.rejected == len(session.events) - len(usable)
    _check_traces_are_well_formed(result, session.events)
    for trace, event in zip(result.traces, usable):
        assert trace.token_ids.tolist() == full(event)
        assert trace.loss_mask.tolist() == [0] * len(event.prompt_token_ids) + [1] * len(event.token_ids)


@settings(max_examples=100, deadline=None)
@given(sessions(), st.data())
def test_tokens_without_logprobs_are_counted_and_never_trained(session: GeneratedSession,
                                                               data: st.DataObject) -> None:
    knocked: set[int] = set()
    events = []
    for event in session.events:
        if event.status == "ok" and len(event.token_ids) and data.draw(st.booleans()):
            logprobs = event.logprobs.numpy.copy()
            logprobs[data.draw(st.integers(0, len(logprobs) - 1))] = np.nan
            knocked.update(np.asarray(event.token_ids.tolist())[np.isnan(logprobs)].tolist())
            event = event.model_copy(update={"logprobs": Logprobs(logprobs)})
        events.append(event)
    result = build_trajectory("prefix_merging", events, FACTS)
    expected = [t for t in session.trained if t not in knocked]
    assert Counter(_trained_tokens(result)) == Counter(expected)
    assert result.stats.missing_logprobs == len(set(session.trained) & knocked)
