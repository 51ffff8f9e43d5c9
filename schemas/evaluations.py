"""Evaluations: an evaluator's verdict on a session (reward and details) on `evaluations`."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from schemas.envelope import Event
from schemas.topics import Topic


class Evaluation(Event):
    """A reward for one session from one evaluator."""

    topic: ClassVar[Topic] = Topic.EVALUATIONS
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["evaluation"] = "evaluation"
    schema_version: Literal[1] = 1
    session_id: str = Field(min_length=1)
    task_id: str | None = None
    evaluator: str = Field(min_length=1)
    evaluator_version: str | None = None  # which version of the evaluator scored it
    status: Literal["ok", "error"] = "ok"
    reward: float | None = Field(default=None, description="None only when status is 'error'.")
    passed: bool | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None

    @model_validator(mode="after")
    def _reward_or_error(self) -> Evaluation:
        if self.status == "ok" and self.reward is None:
            raise ValueError("an evaluation with status 'ok' needs a reward")
        if self.status == "error" and not self.error:
            raise ValueError("an evaluation with status 'error' must say why (error)")
        return self
