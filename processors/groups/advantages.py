"""GRPO advantages for one task's group of samples: pure arithmetic, no Kafka.

Every sample is put in one of three classes first (:func:`classify`):

- ``scored``: the session completed and the task's evaluator gave it a reward. Only these enter the
  baseline (the group's mean and std) and get a non-zero advantage.
- ``failed``: the policy's failure: the session ended with status error, timeout or cancelled (and was
  not the infrastructure's fault), or its evaluation gave no reward. Kept out of the baseline, advantage
  0: it is in the batch (its tokens are real) but pushes the policy nowhere.
- ``infrastructure``: the session failed for a reason that is not the policy's (failure kind
  ``infrastructure``, by the rule in schemas/attribution.py), its evaluator crashed (evaluation status
  ``error``), its trajectory is partial (the session never reported its end) or it never arrived at all.
  Advantage ``None``: not learnt from (the rollout server resubmits session failures of this kind).
- ``unknown``: the session's failure could not be attributed (failure kind ``unknown``). Advantage
  ``None`` and out of the baseline, like infrastructure: never counted as the policy's failure.

A group's *usable* samples are the scored and the failed ones: those the policy can be judged on. The
worker marks a group whose usable share is under its minimum ``insufficient`` (:func:`usable_count`),
and the trainer feed leaves it out.

Estimators:

- ``grpo``: ``(r - mean) / (std + eps)`` over the baseline, with the sample standard deviation
  (``ddof=1``, as TRL's and verl's GRPO compute it with ``torch.std``).
- ``leave_one_out`` (RLOO): ``r_i - mean(r_j for j != i)``, not divided by a std.

A group is ``no_signal`` when its baseline has fewer than two samples or all its rewards are equal: every
advantage is then 0 (GRPO's numerator is 0 anyway; leave-one-out would be 0 too), and the trainer may
skip it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from schemas.groups import GroupSample
from schemas.sessions import FailureKind, SessionStatus

Estimator = Literal["grpo", "leave_one_out"]
DEFAULT_EPS: float = 1e-6


class SampleClass(str, enum.Enum):
    """How a sample takes part in its group."""

    SCORED = "scored"
    FAILED = "failed"
    INFRASTRUCTURE = "infrastructure"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class SampleOutcome:
    """What the group knows about one session when it is emitted."""

    session_id: str
    reward: float | None = None
    status: SessionStatus | None = None
    failure: FailureKind | None = None
    trajectory_id: str | None = None
    evaluation_error: bool = False
    """The evaluation has status 'error' (the evaluator could not score it)."""
    partial: bool = False
    """The trajectory was built before the session ended (it never reported its end)."""
    missing: bool = False
    """No trajectory arrived before the group was emitted."""
    attempt: int = 0
    """Which session of its sample this is (0: the task's own; n: the n-th resubmission)."""


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """The group's samples with advantages, and its baseline."""

    samples: list[GroupSample]
    baseline_mean: float | None
    baseline_std: float | None
    no_signal: bool


def classify(outcome: SampleOutcome) -> SampleClass:
    """The sample's class (see the module docstring)."""
    if outcome.missing or outcome.partial or outcome.status is None:
        return SampleClass.INFRASTRUCTURE
    if outcome.failure is FailureKind.INFRASTRUCTURE:
        return SampleClass.INFRASTRUCTURE
    if outcome.failure is FailureKind.UNKNOWN:
        return SampleClass.UNKNOWN
    if outcome.status is not SessionStatus.COMPLETED:
        return SampleClass.FAILED
    if outcome.evaluation_error:
        return SampleClass.INFRASTRUCTURE  # the evaluator crashed: nothing of the policy's is known
    if outcome.reward is None or not math.isfinite(outcome.reward):
        return SampleClass.FAILED
    return SampleClass.SCORED


def usable_count(outcomes: Sequence[SampleOutcome]) -> int:
    """How many samples the policy can be judged on (scored or failed by the policy)."""
    return sum(classify(o) in (SampleClass.SCORED, SampleClass.FAILED) for o in outcomes)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _sample_std(values: Sequence[float], mean: float) -> float:
    if len(values) < 2:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def compute_advantages(outcomes: Sequence[SampleOutcome], *, estimator: Estimator = "grpo",
                       eps: float = DEFAULT_EPS) -> GroupAdvantages:
    """Advantages for every sample, in the order given; the baseline is the scored samples only."""
    if estimator not in ("grpo", "leave_one_out"):
        raise ValueError(f"unknown advantage estimator {estimator!r}: use 'grpo' or 'leave_one_out'")
    classes = [classify(o) for o in outcomes]
    rewards = [float(o.reward) for o, c in zip(outcomes, classes) if c is SampleClass.SCORED]  # type: ignore[arg-type]
    mean = _mean(rewards) if rewards else None
    std = _sample_std(rewards, mean) if mean is not None else None
    no_signal = len(rewards) < 2 or max(rewards) == min(rewards)

    samples: list[GroupSample] = []
    for outcome, cls in zip(outcomes, classes):
        advantage: float | None
        if cls in (SampleClass.INFRASTRUCTURE, SampleClass.UNKNOWN):
            advantage = None
        elif cls is SampleClass.FAILED or no_signal:
            advantage = 0.0
        else:
            reward = float(outcome.reward)  # type: ignore[arg-type]
            assert mean is not None and std is not None
            if estimator == "grpo":
                advantage = (reward - mean) / (std + eps)
            else:
                n = len(rewards)
                advantage = reward - (mean * n - reward) / (n - 1)
        failure = outcome.failure
        if cls is SampleClass.INFRASTRUCTURE and failure is None:
            failure = FailureKind.INFRASTRUCTURE  # missing, partial or not evaluated: not trained on
        samples.append(GroupSample(
            session_id=outcome.session_id, trajectory_id=outcome.trajectory_id,
            reward=outcome.reward, advantage=advantage, status=outcome.status, failure=failure,
            attempt=outcome.attempt, in_baseline=cls is SampleClass.SCORED))
    return GroupAdvantages(samples, mean, std, no_signal)
