"""Builders over completions that carry the proxy's ``continuation`` block: cut turns in the middle of a
trace, abandoned retries, branch roles and the counts of how prompts were built (exact calls, drift).

Tokens as in test_builders.py: 1-9 system/user text, 10-19 and 40-49 sampled, 20-39 tool results,
99 end-of-turn (also the close token the proxy adds after a cut turn).
"""

from __future__ import annotations

import json

import pytest

from processors.builders import BUILDERS, SessionFacts, build_trajectory
from schemas.completions import ToolDefinition
from schemas.trajectories import Trace, Trajectory
from tests.processors.factory import SESSION, continuation, full, make_call

FACTS = SessionFacts(session_id=SESSION, task_id="t-1")
EOT = 99


def merge(*calls) -> Trajectory:
    return build_trajectory("prefix_merging", calls, FACTS)


def trained(trace: Trace) -> list[int]:
    return trace.token_ids.numpy[trace.loss_mask.numpy == 1].tolist()


def test_length_cut_middle_turn_is_listed_and_its_close_token_is_context() -> None:
    """Turn two stopped at `length`; the proxy closed it with EOT (never sampled) and continued exactly."""
    c0 = make_call(0, [1, 2, 3], [10, EOT], finish_reason="tool_calls",
                   continued=continuation(mode="rendered", drift=None))
    c1 = make_call(1, full(c0) + [20, 5], [11, 12], finish_reason="length",
                   continued=continuation(parent_sequence=0))
    close = len(full(c1))  # where the proxy's close token sits in the next prompt
    c2 = make_call(2, full(c1) + [EOT, 21, 5], [13, EOT],
                   continued=continuation(parent_sequence=1, closed_cut_turn=True))
    result = merge(c2, c0, c1)
    (trace,) = result.traces
    assert trace.sequences == [0, 1, 2] and trace.token_ids.tolist() == full(c2)
    assert trace.cut_turns == [1] and not trace.truncated
    assert trace.token_ids.tolist()[close] == EOT and trace.loss_mask.tolist()[close] == 0
    assert trained(trace) == [10, EOT, 11, 12, 13, EOT]
    stats = result.stats
    assert (stats.cut_turns, stats.truncated, stats.closed_cut_turns, stats.exact_calls) == (1, 0, 1, 2)
    assert stats.drift == {"none": 2} and stats.problems == []


def test_cut_last_turn_is_both_truncated_and_listed() -> None:
    cut = make_call(0, [1, 2], [10, 11], finish_reason="length")
    for name in BUILDERS:
        result = build_trajectory(name, [cut], FACTS)
        assert result.traces[0].cut_turns == [0] and result.traces[0].truncated
        assert (result.stats.cut_turns, result.stats.truncated) == (1, 1)


def test_abandoned_retry_is_listed_and_named_in_the_problems() -> None:
    """The proxy marks the re-asked turn (``retry_of_sequence``): the abandoned attempt is dropped and named,
    even though the retry's new messages differ from the attempt's (only the mark ties them)."""
    c0 = make_call(0, [1, 2], [10, EOT], continued=continuation(mode="rendered", drift=None))
    abandoned = make_call(1, full(c0) + [20], [11, EOT], continued=continuation(parent_sequence=0))
    retry = make_call(2, full(c0) + [21], [12, EOT],
                      continued=continuation(parent_sequence=0, retry_of_sequence=1))
    c3 = make_call(3, full(retry) + [22], [13, EOT], continued=continuation(parent_sequence=2))
    result = merge(c0, abandoned, retry, c3)
    (trace,) = result.traces
    assert trace.sequences == [0, 2, 3] and trained(trace) == [10, EOT, 12, EOT, 13, EOT]
    stats = result.stats
    assert stats.abandoned == [1] and stats.retries == 1
    (problem,) = stats.problems
    assert abandoned.event_id in problem and "(sequence 1)" in problem and "sequence 2" in problem
    assert "abandoned" in problem
    # per_request keeps every attempt as its own row: nothing abandoned, the mark still counted.
    rows = build_trajectory("per_request", [c0, abandoned, retry, c3], FACTS)
    assert rows.stats.abandoned == [] and rows.stats.retries == 1 and len(rows.traces) == 4


def test_last_turn_retried_without_a_mark_abandons_the_earlier_attempt() -> None:
    c0 = make_call(0, [1, 2], [10, EOT])
    first = make_call(1, full(c0) + [20], [11, EOT])
    second = make_call(2, full(c0) + [20], [12, EOT])
    stats = merge(c0, first, second).stats
    assert stats.abandoned == [1]
    assert any("(sequence 1) was abandoned" in p and "sequence 2" in p for p in stats.problems)


def test_main_and_side_branches_get_their_roles() -> None:
    """A title call on its own prompt (role side, branch b1) between two main turns: two traces, by role."""
    c0 = make_call(0, [1, 2, 3], [10, EOT], continued=continuation(mode="rendered"))
    title = make_call(1, [7, 8], [41, EOT], continued=continuation(mode="rendered", branch="b1", role="side"))
    c2 = make_call(2, full(c0) + [20], [11, EOT], continued=continuation(parent_sequence=0))
    result = merge(c0, title, c2)
    assert [(t.sequences, t.role) for t in result.traces] == [([0, 2], "main"), ([1], "side")]
    assert result.stats.roles == {"main": 1, "side": 1}
    rows = build_trajectory("per_request", [c0, title, c2], FACTS)
    assert [t.role for t in rows.traces] == ["main", "side", "main"]
    assert rows.stats.roles == {"main": 2, "side": 1}


def test_side_call_on_the_agents_context_does_not_join_the_agents_row() -> None:
    """A side call whose prompt extends the main tip opens its own branch; the agent's row goes on."""
    c0 = make_call(0, [1, 2, 3], [10, EOT], continued=continuation(mode="rendered"))
    summary = make_call(1, full(c0) + [6], [41, EOT],
                        continued=continuation(branch="b1", role="side", parent_sequence=0))
    c2 = make_call(2, full(c0) + [20], [11, EOT], continued=continuation(parent_sequence=0))
    sub = make_call(3, full(c2) + [7], [42, EOT],
                    continued=continuation(branch="b2", role="sub_agent", parent_sequence=2))
    sub1 = make_call(4, full(sub) + [30], [43, EOT],
                     continued=continuation(branch="b2", role="sub_agent", parent_sequence=3))
    result = merge(c0, summary, c2, sub, sub1)
    assert [(t.sequences, t.role, t.parent_branch) for t in result.traces] == [
        ([0, 2], "main", None), ([1], "side", 0), ([3, 4], "sub_agent", 0)]
    assert [trained(t) for t in result.traces] == [[10, EOT, 11, EOT], [41, EOT], [42, EOT, 43, EOT]]
    assert result.stats.roles == {"main": 1, "side": 1, "sub_agent": 1}


def test_drift_kinds_and_exact_calls_are_counted() -> None:
    c0 = make_call(0, [1, 2], [10, EOT], continued=continuation(mode="rendered", drift=None))
    c1 = make_call(1, full(c0) + [20], [11, EOT], continued=continuation(parent_sequence=0))
    c2 = make_call(2, full(c1) + [21], [12, EOT], continued=continuation(
        parent_sequence=1, drift=["reasoning_stripped", "tool_arguments_reserialized"]))
    c3 = make_call(3, full(c2) + [22], [13, EOT], continued=continuation(parent_sequence=2, drift=["template"]))
    rendered = make_call(4, [3, 4], [40, EOT], continued=continuation(mode="rendered", branch="b1",
                                                                       drift=["retokenized_text"]))
    older = make_call(5, [5, 6], [41, EOT])  # recorded before the continuation block existed
    failed = make_call(6, [5, 6], [], status="error", continued=continuation(drift=["other"]))
    for name in BUILDERS:
        stats = build_trajectory(name, [c0, c1, c2, c3, rendered, older, failed], FACTS).stats
        assert stats.exact_calls == 3
        assert stats.drift == {"none": 1, "reasoning_stripped": 1, "retokenized_text": 1, "template": 1,
                               "tool_arguments_reserialized": 1}
        assert stats.closed_cut_turns == 0


def test_older_events_are_main_with_no_continuation_counts() -> None:
    c0 = make_call(0, [1, 2], [10, EOT])
    side = make_call(1, [7, 8], [41, EOT])
    for name in BUILDERS:
        result = build_trajectory(name, [c0, side], FACTS)
        assert {t.role for t in result.traces} == {"main"}
        assert result.stats.roles == {"main": 2}
        assert (result.stats.exact_calls, result.stats.drift, result.stats.closed_cut_turns) == (0, {}, 0)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_trajectories_written_before_these_fields_still_decode(name: str) -> None:
    c0 = make_call(0, [1, 2], [10, EOT], continued=continuation(mode="rendered", role="side"))
    event = json.loads(build_trajectory(name, [c0], FACTS).model_dump_json())
    for trace in event["traces"]:
        del trace["cut_turns"], trace["role"]
    for field in ("cut_turns", "abandoned", "roles", "exact_calls", "drift", "closed_cut_turns"):
        del event["stats"][field]
    old = Trajectory.model_validate(event)
    assert old.traces[0].role == "main" and old.traces[0].cut_turns == []
    assert (old.stats.roles, old.stats.abandoned, old.stats.exact_calls, old.stats.drift) == ({}, [], 0, {})


def _with_tools(call, *names: str):
    """``call`` as if its request offered the tools ``names``."""
    tools = [ToolDefinition(name=name) for name in names]
    return call.model_copy(update={"request": call.request.model_copy(update={"tools": tools})})


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_a_tool_less_first_call_is_a_side_trace_once_the_agent_offers_tools(builder: str) -> None:
    """opencode asks for the session's title (no tools) before its agent's first call: the proxy, seeing no
    line yet, recorded the title as ``main``; the built trajectory knows better and names it ``side``."""
    title = make_call(0, [1, 2], [10, EOT], continued=continuation(mode="rendered", branch="b0", role="main"))
    agent0 = _with_tools(make_call(1, [3, 4], [11, EOT], finish_reason="tool_calls",
                                   continued=continuation(mode="rendered", branch="b1", role="main")), "write")
    agent1 = _with_tools(make_call(2, full(agent0) + [20, 5], [12, EOT],
                                   continued=continuation(parent_sequence=1, branch="b1", role="main")), "write")
    result = build_trajectory(builder, [title, agent0, agent1], FACTS)
    roles = {trace.sequences[0]: trace.role for trace in result.traces}
    assert roles[0] == "side" and roles[1] == "main", roles
    assert result.stats.roles["side"] == 1


def test_a_session_without_tools_keeps_its_main_trace() -> None:
    # A plain chat session (no call offers tools): nothing tells a side call apart, the line stays main.
    only = make_call(0, [1, 2], [10, EOT], continued=continuation(mode="rendered", role="main"))
    (trace,) = merge(only).traces
    assert trace.role == "main"
