"""Trajectory builders on hand-made token sequences: each test pins one rule of the builders.

Tokens: 1-9 system/user text, 10-19 and 40-49 sampled, 20-39 tool results, 99 end-of-turn.
"""

from __future__ import annotations

import math
import random
from typing import get_args

import numpy as np
import pytest

from processors.builders import BUILDERS, SessionFacts, UnknownBuilder, build_trajectory, get_builder
from processors.builders.prefix_merging import common_prefix_len
from schemas.tasks import BuilderName
from schemas.trajectories import Trace, Trajectory
from tests.processors.factory import SESSION, full, logprob_of, make_call

FACTS = SessionFacts(session_id=SESSION, task_id="t-1")
EOT = 99


def merge(*calls) -> Trajectory:
    return build_trajectory("prefix_merging", calls, FACTS)


def per_request(*calls) -> Trajectory:
    return build_trajectory("per_request", calls, FACTS)


def trained(trace: Trace) -> list[int]:
    """The tokens a trace trains on (mask 1), in order."""
    return trace.token_ids.numpy[trace.loss_mask.numpy == 1].tolist()


def assert_logprobs_follow_mask(trace: Trace) -> None:
    mask, logprobs, tokens = trace.loss_mask.numpy, trace.logprobs.numpy, trace.token_ids.numpy
    assert np.isnan(logprobs[mask == 0]).all()
    assert logprobs[mask == 1].tolist() == [logprob_of(t) for t in tokens[mask == 1].tolist()]


def test_registry_matches_the_builder_names_of_the_schema() -> None:
    assert sorted(BUILDERS) == sorted(get_args(BuilderName))
    with pytest.raises(UnknownBuilder, match="per_request"):
        get_builder("by_vibes")


def test_two_turn_merge() -> None:
    """Turn two's prompt extends turn one: one row, sampled spans mask 1, tool result and glue mask 0."""
    c0 = make_call(0, [1, 2, 3], [10, 11, EOT], finish_reason="tool_calls")
    c1 = make_call(1, full(c0) + [20, 21, 5], [12, EOT])
    result = merge(c0, c1)
    (trace,) = result.traces
    assert trace.token_ids.tolist() == full(c1)
    assert trace.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    assert_logprobs_follow_mask(trace)
    assert (trace.trace_id, trace.branch, trace.parent_branch) == (f"{SESSION}/0", 0, None)
    assert trace.completion_ids == [c0.event_id, c1.event_id] and trace.sequences == [0, 1]
    assert not trace.truncated
    stats = result.stats
    assert (stats.completions, stats.traces, stats.merged, stats.branches) == (2, 1, 1, 1)
    assert stats.problems == []
    assert result.builder == "prefix_merging" and result.task_id == "t-1"


def test_missing_logprobs_are_an_explicit_error() -> None:
    """No logprobs at all, or a NaN among them: counted, named in problems, and never trained on."""
    c0 = make_call(0, [1, 2], [10, 11, EOT], logprobs=None)
    c1 = make_call(1, full(c0) + [20], [12, 13, EOT], logprobs=[-0.5, float("nan"), -0.25])
    for result in (merge(c0, c1), per_request(c0, c1)):
        assert result.stats.missing_logprobs == 4
        assert any(c0.event_id in p and "3 of 3" in p for p in result.stats.problems)
        assert any(c1.event_id in p and "1 of 3" in p for p in result.stats.problems)
        trained_logprobs = np.concatenate([t.logprobs.numpy[t.loss_mask.numpy == 1] for t in result.traces])
        assert trained_logprobs.tolist() == [-0.5, -0.25]
    (trace,) = merge(c0, c1).traces
    assert trained(trace) == [12, EOT]


def test_history_rewrite_opens_a_branch_with_its_parent() -> None:
    """A prompt that extends turn one but not turn two forks; tokens trained in the parent stay mask 0."""
    c0 = make_call(0, [1, 2, 3], [10, 11, EOT])
    c1 = make_call(1, full(c0) + [20, 21], [12, EOT])
    c2 = make_call(2, full(c0) + [30, 31, 32], [40, EOT])  # turn two's result rewritten (e.g. elided)
    result = merge(c0, c1, c2)
    main, fork = result.traces
    assert main.token_ids.tolist() == full(c1) and main.sequences == [0, 1]
    assert (fork.branch, fork.parent_branch, fork.sequences) == (1, 0, [2])
    assert fork.token_ids.tolist() == full(c2)
    assert trained(fork) == [40, EOT]
    assert trained(main) == [10, 11, EOT, 12, EOT]
    for trace in result.traces:
        assert_logprobs_follow_mask(trace)
    assert (result.stats.branches, result.stats.merged, result.stats.traces) == (2, 1, 2)


def test_prompt_extending_no_turn_opens_a_root_branch() -> None:
    """A side call (title generation) with its own prompt is a new root, not glued onto the agent."""
    c0 = make_call(0, [1, 2, 3], [10, EOT])
    title = make_call(1, [7, 8], [41, EOT])
    c2 = make_call(2, full(c0) + [20], [11, EOT])
    result = merge(c0, title, c2)
    assert [(t.branch, t.parent_branch, t.sequences) for t in result.traces] == [(0, None, [0, 2]), (1, None, [1])]


def test_two_interleaved_agents_keep_separate_branches() -> None:
    a0 = make_call(0, [1, 2], [10, EOT])
    b0 = make_call(1, [3, 4], [40, EOT])
    a1 = make_call(2, full(a0) + [20], [11, EOT])
    b1 = make_call(3, full(b0) + [30], [41, EOT])
    a2 = make_call(4, full(a1) + [21], [12, EOT])
    result = merge(b1, a2, a0, b0, a1)
    agent_a, agent_b = result.traces
    assert (agent_a.sequences, agent_b.sequences) == ([0, 2, 4], [1, 3])
    assert agent_a.token_ids.tolist() == full(a2) and agent_b.token_ids.tolist() == full(b1)
    assert agent_b.parent_branch is None
    assert (result.stats.branches, result.stats.merged) == (2, 3)


def test_retry_marked_by_the_proxy_keeps_the_attempt_the_harness_continued() -> None:
    """Both attempts succeeded; the harness continued the retry: it is kept, the original dropped, no fork."""
    c0 = make_call(0, [1, 2], [10, EOT])
    first = make_call(1, full(c0) + [20], [11, EOT])
    retry = make_call(2, full(c0) + [20], [12, EOT], retry_of=1)
    c3 = make_call(3, full(retry) + [21], [13, EOT])
    result = merge(c0, first, retry, c3)
    (trace,) = result.traces
    assert trace.sequences == [0, 2, 3]
    assert trained(trace) == [10, EOT, 12, EOT, 13, EOT]
    assert (result.stats.retries, result.stats.branches, result.stats.rejected) == (1, 1, 0)
    assert result.stats.abandoned == [1]
    assert any(first.event_id in p and "abandoned" in p and "sequence 2" in p for p in result.stats.problems)


def test_retry_by_identical_prompt_after_the_original_was_continued_is_dropped() -> None:
    c0 = make_call(0, [1, 2], [10, EOT])
    c1 = make_call(1, full(c0) + [20], [11, EOT])
    c2 = make_call(2, full(c1) + [21], [12, EOT])
    again = make_call(3, full(c0) + [20], [13, EOT])  # same prompt as c1, never continued
    result = merge(c0, c1, c2, again)
    (trace,) = result.traces
    assert trace.sequences == [0, 1, 2]
    assert result.stats.retries == 1
    assert result.stats.abandoned == [3]


def test_last_turn_retried_keeps_the_later_attempt() -> None:
    """When neither attempt was continued (the session ended), the later one is kept."""
    c0 = make_call(0, [1, 2], [10, EOT])
    first = make_call(1, full(c0) + [20], [11, EOT])
    second = make_call(2, full(c0) + [20], [12, EOT])
    (trace,) = merge(c0, first, second).traces
    assert trace.sequences == [0, 2] and trained(trace) == [10, EOT, 12, EOT]


def test_retry_of_a_failed_call() -> None:
    c0 = make_call(0, [1, 2], [10, EOT])
    failed = make_call(1, full(c0) + [20], [], status="error")
    retry = make_call(2, full(c0) + [20], [11, EOT], retry_of=1)
    result = merge(c0, failed, retry)
    (trace,) = result.traces
    assert trace.sequences == [0, 2]
    assert (result.stats.retries, result.stats.rejected, result.stats.completions) == (1, 1, 3)


def test_attempts_that_were_each_continued_are_kept_and_reported() -> None:
    """Identical prompts both continued are separate agents (e.g. two sub-agents): both branches, one problem."""
    c0 = make_call(0, [1, 2], [10, EOT])
    x = make_call(1, full(c0) + [20], [11, EOT])
    y = make_call(2, full(c0) + [20], [12, EOT])
    x1 = make_call(3, full(x) + [21], [13, EOT])
    y1 = make_call(4, full(y) + [22], [14, EOT])
    result = merge(c0, x, y, x1, y1)
    assert [(t.sequences, t.parent_branch) for t in result.traces] == [([0, 1, 3], None), ([2, 4], 0)]
    assert len(result.stats.problems) == 1 and "each continued" in result.stats.problems[0]


def test_length_truncated_turn_is_closed() -> None:
    """A turn cut by `length` has no end-of-turn token; the template's glue after it is context (mask 0)."""
    cut = make_call(0, [1, 2], [10, 11], finish_reason="length")
    alone = merge(cut)
    assert alone.traces[0].truncated and alone.traces[0].cut_turns == [0] and alone.stats.truncated == 1
    nxt = make_call(1, full(cut) + [EOT, 20], [12, EOT])
    result = merge(cut, nxt)
    (trace,) = result.traces
    assert trace.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert not trace.truncated and result.stats.truncated == 0
    assert trace.cut_turns == [0] and result.stats.cut_turns == 1  # the cut is in the middle now
    assert_logprobs_follow_mask(trace)


def test_per_request_on_one_call() -> None:
    call = make_call(0, [1, 2, 3], [10, EOT])
    result = per_request(call)
    (trace,) = result.traces
    assert trace.token_ids.tolist() == [1, 2, 3, 10, EOT]
    assert trace.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert_logprobs_follow_mask(trace)
    assert (trace.trace_id, trace.completion_ids) == (f"{SESSION}/r0", [call.event_id])
    assert result.builder == "per_request" and result.stats.traces == 1


def test_per_request_rows_are_the_usable_completions() -> None:
    c0 = make_call(0, [1, 2], [10, EOT])
    c1 = make_call(1, full(c0) + [20], [11, EOT])
    failed = make_call(2, full(c1) + [21], [], status="error")
    result = per_request(c0, c1, failed)
    assert [t.sequences for t in result.traces] == [[0], [1]]
    assert result.stats.rejected == 1 and result.stats.completions == 3


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_failed_call_is_rejected(name: str) -> None:
    ok = make_call(0, [1, 2], [10, EOT])
    failed = make_call(1, full(ok) + [20], [], status="error")
    result = build_trajectory(name, [ok, failed], FACTS)
    assert [t.sequences for t in result.traces] == [[0]]
    assert (result.stats.rejected, result.stats.completions) == (1, 2)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_out_of_order_and_duplicate_events_give_the_same_trajectory(name: str) -> None:
    """Kafka redelivers and partitions interleave: the result (event id included) must not change."""
    c0 = make_call(0, [1, 2], [10, EOT])
    c1 = make_call(1, full(c0) + [20], [11, EOT])
    side = make_call(2, [5, 6], [41, EOT])
    c3 = make_call(3, full(c1) + [21], [12, EOT])
    reference = build_trajectory(name, [c0, c1, side, c3], FACTS)
    shuffled = [c3, c1, c0, side, c1, c3]
    random.Random(7).shuffle(shuffled)
    again = build_trajectory(name, shuffled, FACTS)
    assert again == reference
    assert again.stats.completions == 4


def test_equally_long_prefixes_are_reported_with_a_deterministic_choice() -> None:
    """Two agents that happen to produce identical sequences: the next prompt extends both."""
    a = make_call(0, [1, 2], [10, EOT])
    b = make_call(1, [1, 2, 10], [EOT])  # b's full sequence equals a's
    c = make_call(2, full(a) + [20], [11, EOT])
    result = merge(a, b, c)
    assert [t.sequences for t in result.traces] == [[0, 2], [1]]
    assert any("equally long" in p for p in result.stats.problems)


def test_foreign_session_and_tokenless_calls_are_rejected_and_named() -> None:
    ok = make_call(0, [1, 2], [10, EOT])
    foreign = make_call(1, [1, 2], [10, EOT], session_id="other")
    tokenless = make_call(2, [1], [10]).model_copy(update={"token_ids": None, "logprobs": None})
    result = merge(ok, foreign, tokenless)
    assert result.stats.rejected == 2 and len(result.traces) == 1
    assert any(foreign.event_id in p for p in result.stats.problems)
    assert any(tokenless.event_id in p and "no token ids" in p for p in result.stats.problems)


def test_mixed_policy_versions_are_reported() -> None:
    a = make_call(0, [1, 2], [10, EOT], policy_version="step-1")
    b = make_call(1, full(a) + [20], [11, EOT], policy_version="step-2")
    result = build_trajectory("prefix_merging", [a, b], SessionFacts(session_id=SESSION))
    assert any("policy version" in p for p in result.stats.problems)


def test_trajectory_survives_the_wire() -> None:
    c0 = make_call(0, [1, 2], [10, EOT])
    c1 = make_call(1, full(c0) + [20], [11, EOT])
    result = merge(c0, c1)
    decoded = Trajectory.model_validate_json(result.model_dump_json())
    assert decoded == result
    assert math.isnan(decoded.traces[0].logprobs[0])


def test_empty_session() -> None:
    for name in BUILDERS:
        result = build_trajectory(name, [], FACTS)
        assert result.traces == [] and result.stats.completions == 0


@pytest.mark.parametrize("a, b, want", [
    ([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 5, 3], 1),
    (list(range(5000)), list(range(4000)) + [0] * 1000, 4000),
])
def test_common_prefix_len(a: list[int], b: list[int], want: int) -> None:
    assert common_prefix_len(np.asarray(a, dtype=np.int32), np.asarray(b, dtype=np.int32)) == want


def test_retry_mark_contradicted_by_the_tokens_is_reported() -> None:
    """The proxy's ``retry_of`` is a hint; the tokens decide where a call goes."""
    c0 = make_call(0, [1, 2], [10, EOT])
    c1 = make_call(1, full(c0) + [20], [11, EOT])
    c2 = make_call(2, full(c1) + [21], [12, EOT], retry_of=0)
    result = merge(c0, c1, c2)
    assert [t.sequences for t in result.traces] == [[0, 1, 2]]
    assert result.stats.retries == 1
    assert any("retry of sequence 0" in p for p in result.stats.problems)


def test_bench_merge_hook_takes_recorded_completion_events(tmp_path) -> None:
    """bench.merge reads completion events (JSONL) grouped by session, skipping request-body fixtures."""
    from bench.merge import compare, generate_session, recorded_sessions

    events = generate_session(np.random.default_rng(1), "rec-1", turns=12, tool_tokens=40, system_tokens=30)
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "session.jsonl").write_text("\n".join(e.model_dump_json() for e in events))
    (tmp_path / "cli" / "call_0.json").write_text('{"cli": "pi", "body": {"messages": []}}')
    (recorded,) = recorded_sessions(tmp_path)
    figures = compare([recorded])
    assert figures.per_request_rows == len(events) == figures.completions
    # main agent, sub-agent fork, history rewrite, two side calls: one row per branch
    assert figures.prefix_merging_rows == figures.branches == 5
    assert figures.problems == 0


def _versioned(sequence: int, prompt: list[int], sampled: list[int], version: str | None,
               spans: list[dict] | None = None):
    call = make_call(sequence, prompt, sampled, policy_version=version)
    return call.model_copy(update={"weight_versions": spans}) if spans is not None else call


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_policy_versions_span_the_completions_and_their_weight_spans(name: str) -> None:
    """versions 2, 2, 3 and a call that straddled the update to 4 give the range (2, 4)."""
    c0 = _versioned(0, [1, 2], [10, EOT], "2")
    c1 = _versioned(1, full(c0) + [20], [11, EOT], "v2")
    c2 = _versioned(2, full(c1) + [21], [12, EOT], "3")
    c3 = _versioned(3, full(c2) + [22], [13, 14, 15, EOT], "3",
                    spans=[{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}])
    result = build_trajectory(name, [c3, c1, c0, c2], FACTS)
    assert result.policy_versions is not None
    assert (result.policy_versions.oldest, result.policy_versions.newest) == (2, 4)
    # The claim string is kept as it was (the session's, else the completions' label).
    claimed = build_trajectory(name, [c0, c1, c2, c3], SessionFacts(session_id=SESSION, policy_version="step-7"))
    assert claimed.policy_version == "step-7" and claimed.policy_versions == result.policy_versions


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_labels_that_are_no_version_give_no_range(name: str) -> None:
    c0 = _versioned(0, [1, 2], [10, EOT], "step-3")
    c1 = _versioned(1, full(c0) + [20], [11, EOT], None, spans=[{"version": "rc1", "start": 0, "end": 2}])
    result = build_trajectory(name, [c0, c1], FACTS)
    assert result.policy_versions is None
    assert any("weight version span" in p for p in result.stats.problems)
    assert build_trajectory(name, [], FACTS).policy_versions is None


def test_an_abandoned_retry_does_not_count_in_the_range() -> None:
    """Only completions a trace holds count: an abandoned attempt's tokens are never trained on."""
    c0 = _versioned(0, [1, 2], [10, EOT], "5")
    dropped = _versioned(1, full(c0) + [20], [11, EOT], "1")
    kept = _versioned(2, full(c0) + [20], [12, EOT], "6")
    result = merge(c0, dropped, kept)
    assert result.stats.abandoned == [1]
    assert result.policy_versions is not None
    assert (result.policy_versions.oldest, result.policy_versions.newest) == (5, 6)
