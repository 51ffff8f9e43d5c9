"""Groups: all samples of a task with rewards and GRPO advantages, on `groups`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from schemas.envelope import Event, Model
from schemas.policy import PolicyRange
from schemas.sessions import FailureKind, SessionStatus
from schemas.topics import Topic


class GroupSample(Model):
    """One session of the group."""

    session_id: str
    trajectory_id: str | None = Field(default=None, description="Event id of its trajectory.")
    reward: float | None = None
    advantage: float | None = Field(default=None, description="None when kept out of training.")
    status: SessionStatus | None = None
    failure: FailureKind | None = None
    attempt: int = Field(default=0, description="Which session of the sample this is (0: the first; n: its n-th resubmission).")
    in_baseline: bool = Field(description="Whether its reward entered the group's mean and std.")


class Group(Event):
    """A task's samples, ready for one GRPO step."""

    topic: ClassVar[Topic] = Topic.GROUPS
    key_field: ClassVar[str] = "task_id"

    event_type: Literal["group"] = "group"
    schema_version: Literal[1] = 1
    task_id: str = Field(min_length=1)
    group_id: str | None = None
    policy_version: str | None = None
    policy_versions: PolicyRange | None = Field(default=None, description=(
        "The oldest and newest engine weight version among its samples' trajectories."))
    samples: list[GroupSample]
    baseline_mean: float | None = None
    baseline_std: float | None = None
    complete: bool = Field(default=True, description="False when emitted at a deadline with samples missing.")
    # How the advantages were computed (processors/groups) and whether they carry signal.
    no_signal: bool = Field(default=False, description=(
        "All baseline rewards equal (or fewer than two): every advantage is 0, no gradient signal."))
    evaluator: str | None = Field(default=None, description="Evaluator whose rewards the group uses.")
    estimator: Literal["grpo", "leave_one_out"] | None = Field(default=None, description="Advantage estimator.")
    usable: int | None = Field(default=None, description=(
        "Samples the policy can be judged on: scored, or failed by the policy (not infrastructure, not unknown)."))
    insufficient: bool = Field(default=False, description=(
        "Fewer than the groups worker's minimum share of samples are usable: kept out of the trainer feed."))
