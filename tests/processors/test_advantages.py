"""GRPO and leave-one-out advantages on hand-computed groups.

The numbers below are worked out by hand in the comments, so a change to the estimator (population
instead of sample std, failed samples leaking into the baseline, infrastructure failures getting a 0
instead of None) shows up as a wrong number, not as a silently different one.
"""

from __future__ import annotations

import math

import pytest

from processors.groups.advantages import usable_count, SampleClass, SampleOutcome, classify, compute_advantages
from schemas.sessions import FailureKind, SessionStatus

OK = SessionStatus.COMPLETED


def scored(session_id: str, reward: float) -> SampleOutcome:
    return SampleOutcome(session_id, reward=reward, status=OK, trajectory_id=f"traj-{session_id}")


def test_grpo_on_two_passes_and_two_fails() -> None:
    # rewards 1, 0, 0, 1: mean 0.5; sample std sqrt((4 * 0.25) / 3) = sqrt(1/3) = 0.57735
    group = compute_advantages([scored("a", 1), scored("b", 0), scored("c", 0), scored("d", 1)], eps=0.0)
    assert group.baseline_mean == pytest.approx(0.5)
    assert group.baseline_std == pytest.approx(math.sqrt(1 / 3))
    advantages = [s.advantage for s in group.samples]
    assert advantages == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-6)
    assert not group.no_signal
    assert all(s.in_baseline for s in group.samples)
    assert [s.trajectory_id for s in group.samples] == ["traj-a", "traj-b", "traj-c", "traj-d"]


def test_grpo_eps_is_added_to_the_std() -> None:
    # rewards 3, 1: mean 2, sample std sqrt(2) = 1.41421; eps 0.5 -> 1 / 1.91421 = 0.522408
    group = compute_advantages([scored("a", 3), scored("b", 1)], eps=0.5)
    assert [s.advantage for s in group.samples] == pytest.approx([0.522408, -0.522408], abs=1e-6)


def test_failed_sessions_stay_out_of_the_baseline_with_zero_advantage() -> None:
    outcomes = [
        scored("a", 1.0),
        scored("b", 0.0),
        scored("c", 0.5),
        # The policy's failures: timeout, error, cancelled.
        SampleOutcome("d", reward=0.0, status=SessionStatus.TIMEOUT, failure=FailureKind.POLICY),
        SampleOutcome("e", reward=1.0, status=SessionStatus.ERROR),
        SampleOutcome("g", reward=0.0, status=SessionStatus.CANCELLED),
    ]
    # Baseline 1, 0, 0.5: mean 0.5, sample std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    group = compute_advantages(outcomes, eps=0.0)
    assert group.baseline_mean == pytest.approx(0.5) and group.baseline_std == pytest.approx(0.5)
    by_id = {s.session_id: s for s in group.samples}
    assert by_id["a"].advantage == pytest.approx(1.0)
    assert by_id["b"].advantage == pytest.approx(-1.0)
    assert by_id["c"].advantage == pytest.approx(0.0)
    for failed in "deg":
        assert by_id[failed].advantage == 0.0 and not by_id[failed].in_baseline
    # e's reward of 1 must not have entered the mean (it would have made it 0.625).
    assert by_id["e"].reward == 1.0


def test_infrastructure_failures_are_flagged_with_no_advantage() -> None:
    outcomes = [
        scored("a", 1.0),
        scored("b", 0.0),
        SampleOutcome("c", reward=0.0, status=SessionStatus.ERROR, failure=FailureKind.INFRASTRUCTURE),
        SampleOutcome("d", reward=1.0, status=OK, failure=FailureKind.INFRASTRUCTURE),
        SampleOutcome("e", partial=True, trajectory_id="traj-e"),
        SampleOutcome("f", missing=True),
    ]
    group = compute_advantages(outcomes, eps=0.0)
    # Baseline 1, 0: mean 0.5, sample std sqrt(0.5) = 0.707107 -> +-0.707107
    by_id = {s.session_id: s for s in group.samples}
    assert by_id["a"].advantage == pytest.approx(0.707107, abs=1e-6)
    assert by_id["b"].advantage == pytest.approx(-0.707107, abs=1e-6)
    for infra in "cdef":
        assert by_id[infra].advantage is None, infra
        assert not by_id[infra].in_baseline
        assert by_id[infra].failure is FailureKind.INFRASTRUCTURE
    assert [classify(o) for o in outcomes] == [SampleClass.SCORED, SampleClass.SCORED] + [SampleClass.INFRASTRUCTURE] * 4


def test_leave_one_out() -> None:
    # rewards 1, 0, 0, 0.5 (and one failed, ignored): each minus the mean of the other three
    #   a: 1 - 0.5/3 = 0.833333   b: 0 - 1.5/3 = -0.5   c: -0.5   d: 0.5 - 1/3 = 0.166667
    outcomes = [scored("a", 1), scored("b", 0), scored("c", 0), scored("d", 0.5),
                SampleOutcome("x", reward=1.0, status=SessionStatus.TIMEOUT)]
    group = compute_advantages(outcomes, estimator="leave_one_out")
    assert [s.advantage for s in group.samples] == pytest.approx([0.833333, -0.5, -0.5, 0.166667, 0.0], abs=1e-6)
    assert group.baseline_mean == pytest.approx(0.375)
    # RLOO advantages sum to zero over the baseline.
    assert sum(s.advantage for s in group.samples[:4]) == pytest.approx(0.0)


@pytest.mark.parametrize("estimator", ["grpo", "leave_one_out"])
def test_all_equal_rewards_are_marked_no_signal(estimator: str) -> None:
    outcomes = [scored("a", 1), scored("b", 1), scored("c", 1),
                SampleOutcome("d", reward=0.0, status=SessionStatus.ERROR),
                SampleOutcome("e", status=SessionStatus.ERROR, failure=FailureKind.INFRASTRUCTURE)]
    group = compute_advantages(outcomes, estimator=estimator)  # type: ignore[arg-type]
    assert group.no_signal
    assert group.baseline_std == 0.0
    assert [s.advantage for s in group.samples] == [0.0, 0.0, 0.0, 0.0, None]


def test_a_lone_scored_sample_has_no_signal() -> None:
    group = compute_advantages([scored("a", 1), SampleOutcome("b", missing=True)], estimator="leave_one_out")
    assert group.no_signal and [s.advantage for s in group.samples] == [0.0, None]


def test_no_scored_sample_at_all() -> None:
    group = compute_advantages([SampleOutcome("a", missing=True),
                                SampleOutcome("b", reward=0.0, status=SessionStatus.TIMEOUT)])
    assert group.no_signal and group.baseline_mean is None and group.baseline_std is None
    assert [s.advantage for s in group.samples] == [None, 0.0]


def test_unknown_estimator_is_refused() -> None:
    with pytest.raises(ValueError, match="leave_one_out"):
        compute_advantages([scored("a", 1)], estimator="ppo")  # type: ignore[arg-type]


def test_evaluator_crash_and_unknown_failures_stay_out_of_baseline_and_training() -> None:
    """A completed session whose evaluator crashed says nothing of the policy (the evaluator's failure is the
    infrastructure's), and a failure the evidence could not attribute is never counted as the policy's: both
    get no advantage, stay out of the baseline, and are not usable."""
    outcomes = [
        scored("a", 1.0),
        scored("b", 0.0),
        SampleOutcome("c", reward=None, status=OK, evaluation_error=True),
        SampleOutcome("d", reward=0.0, status=SessionStatus.ERROR, failure=FailureKind.UNKNOWN),
        SampleOutcome("e", reward=0.0, status=SessionStatus.ERROR, failure=FailureKind.POLICY),
    ]
    group = compute_advantages(outcomes, eps=0.0)
    by_id = {s.session_id: s for s in group.samples}
    assert by_id["c"].advantage is None and by_id["c"].failure is FailureKind.INFRASTRUCTURE
    assert by_id["d"].advantage is None and by_id["d"].failure is FailureKind.UNKNOWN
    assert not by_id["c"].in_baseline and not by_id["d"].in_baseline
    assert by_id["e"].advantage == 0.0
    assert group.baseline_mean == pytest.approx(0.5)
    assert usable_count(outcomes) == 3
