"""Rollout server API models: the answer to a submitted task, task and session status, the task result.

These are HTTP models (not events): the rollout server derives them from the `tasks`, `session-events`,
`evaluations` and `trajectories` topics and serves them at ``/v1/tasks/{task_id}``; the result is also
POSTed to the task's ``callback_url``. Derived views carry no envelope: rebuilding them from the log
gives the same answer.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Literal

from pydantic import Field

from schemas.envelope import Model
from schemas.attribution import Cause
from schemas.sessions import FailureKind, SessionStage, SessionStatus

# ---- rollout server (producers/rollout) ----------------------------------------------------------------


class TaskSubmitted(Model):
    """The 202 answer to ``POST /v1/tasks``: the task and its sessions are on Kafka."""

    task_id: str
    session_ids: list[str]
    status_url: str = Field(description="Where to poll the task's status (relative to the server).")


class TaskState(str, enum.Enum):
    """Where a task is, from its sessions' events."""

    PENDING = "pending"
    """Accepted; no session has started yet."""
    RUNNING = "running"
    """At least one session started and not all have ended."""
    EVALUATING = "evaluating"
    """Every session ended; evaluations are still expected for some."""
    DONE = "done"
    """Every session ended and was evaluated where an evaluator was named (or the wait for it ran out):
    the result is final."""


class EvaluationView(Model):
    """One evaluator's verdict on a session."""

    evaluator: str
    status: Literal["ok", "error"] = "ok"
    reward: float | None = None
    passed: bool | None = None
    error: str | None = None


class RetryView(Model):
    """An earlier session of the same sample, replaced after it failed for the infrastructure."""

    session_id: str
    cause: Cause | None = None
    reason: str | None = None


class SessionStatusView(Model):
    """One session as its events describe it (in a task's status: the sample's latest session, with the
    ones it replaced under ``retries``)."""

    session_id: str
    sample_index: int
    stage: SessionStage = Field(default=SessionStage.QUEUED, description="The last stage entered.")
    status: SessionStatus | None = Field(default=None, description="How it ended; None while it runs.")
    failure: FailureKind | None = None
    cause: Cause | None = None
    reason: str | None = None
    exit_code: int | None = None
    attempt: int = Field(default=0, description="0 for the task's own session; n for the n-th resubmission.")
    retries: list[RetryView] = Field(default_factory=list, description=(
        "The sessions of this sample this one replaced, oldest first."))
    retry_pending: bool = Field(default=False, description=(
        "It failed for the infrastructure and will be resubmitted (the task is not done before)."))
    node: str | None = Field(default=None, description="Gateway node that ran it.")
    started_at: datetime | None = Field(default=None, description="When it left the queue (first stage event).")
    ended_at: datetime | None = None
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per stage.")
    patch_bytes: int | None = Field(default=None, description="Size of the final git patch, if any.")
    completions: int = Field(default=0, description=(
        "Model calls recorded on `completions` for this session (the trajectory's count once built)."))
    trajectory_id: str | None = Field(default=None, description="Event id of its trajectory.")
    traces: int | None = None
    traces_by_role: dict[str, int] = Field(default_factory=dict, description=(
        "Traces per branch role (main, sub_agent, side), as the trajectory's stats count them."))
    partial: bool | None = Field(default=None, description="The trajectory was built before the session ended.")
    evaluations: list[EvaluationView] = Field(default_factory=list)
    reward: float | None = Field(default=None, description="The task's evaluator's reward, when it ran.")

    @property
    def ended(self) -> bool:
        return self.status is not None


class CallbackState(Model):
    """Delivery of the task's result to its callback URL."""

    url: str
    state: Literal["waiting", "sending", "delivered", "failed"] = "waiting"
    attempts: int = 0
    last_error: str | None = None
    delivered_at: datetime | None = None


class TaskResult(Model):
    """A finished task: every session's end, trajectory and reward. POSTed to the callback URL."""

    task_id: str
    group_id: str | None = None
    policy_version: str | None = None
    evaluator: str | None = None
    accepted_at: datetime
    finished_at: datetime
    complete: bool = Field(description=(
        "False when the result went out at the evaluation deadline with evaluations still missing."))
    sessions: list[SessionStatusView]
    mean_reward: float | None = Field(default=None, description="Over sessions with a reward.")


class TaskStatus(Model):
    """``GET /v1/tasks/{task_id}``: the task's state and every session's status."""

    task_id: str
    state: TaskState
    accepted_at: datetime
    num_samples: int
    harness: str
    evaluator: str | None = None
    stages: dict[str, int] = Field(description=(
        "Sessions per stage of those still running, plus 'ended' for those that ended."))
    sessions: list[SessionStatusView]
    callback: CallbackState | None = None
    result: TaskResult | None = Field(default=None, description="Set once the task is done.")


class TaskSummary(Model):
    """One line of ``GET /v1/tasks``."""

    task_id: str
    state: TaskState
    accepted_at: datetime
    num_samples: int
    ended: int


# ---- end of rollout server models ----------------------------------------------------------------------


# ---- gateway node HTTP API (producers/gateway) -------------------------------------------------------


class HeldSession(Model):
    """A session a gateway node holds, as ``GET /v1/sessions`` on the node lists it."""

    session_id: str
    task_id: str | None = None
    stage: SessionStage
    claimed: bool = Field(description="The node sent its `init` event: no other node will start it.")
    cancel_reason: str | None = None


class GatewayHealth(Model):
    """``GET /health`` on a gateway node."""

    status: Literal["ok", "draining"]
    node: str
    group: str
    sessions: dict[str, int] = Field(description="Sessions held, per stage.")
    waiting: int = Field(description="Sessions another live node claimed, waited on before they can be committed.")


class CancelRequest(Model):
    """``POST /v1/sessions/{session_id}/cancel`` on the gateway node that holds the session (body optional)."""

    reason: str = Field(default="cancelled by request", max_length=1000)


class CancelAnswer(Model):
    """The answer to a cancel: the session stops where it is and still ends (status `cancelled`, its patch so far)."""

    session_id: str
    node: str
    stage: SessionStage
    cancelled: bool = Field(description="False when the session was already past its run (it ends on its own).")


# ---- end of gateway node models ------------------------------------------------------------------------
