"""Sessions: the session spec (`sessions`, compacted) and lifecycle events (`session-events`).

A failed session's end names its cause and whose failure it is by the rule in schemas.attribution.

A session is one sample of a task: one harness run against the proxy. Its spec is the registry entry the
proxy checks every call against; its lifecycle events say where it is and how it ended.
"""

from __future__ import annotations

import enum
import re
from typing import Any, ClassVar, Literal

from pydantic import Field

from schemas.attribution import Cause, Evidence, FailureKind
from schemas.envelope import Event
from schemas.tasks import AgentSpec, BuilderName, EngineParams, EvaluatorSpec, RuntimeSpec
from schemas.topics import Topic


_RETRY_SUFFIX = re.compile(r"^(?P<original>.+)-retry(?P<attempt>[1-9][0-9]?)$")


def retry_session_id(original: str, attempt: int) -> str:
    """The id of the ``attempt``-th resubmission of the sample whose first session is ``original``.

    Derived, not random: the rollout server that restarts writes the same id again (a no-op on the
    compacted topic), and the groups worker maps a resubmission's facts to its sample by the id alone
    (:func:`retried_from`)."""
    return f"{original}-retry{attempt}"


def retried_from(session_id: str) -> tuple[str, int] | None:
    """``(first session id, attempt)`` of a resubmitted session's id; None for a first session."""
    match = _RETRY_SUFFIX.match(session_id)
    return (match["original"], int(match["attempt"])) if match else None


class SessionStage(str, enum.Enum):
    """Where a session is in a gateway node's pipeline."""

    QUEUED = "queued"
    INIT = "init"
    READY = "ready"
    RUNNING = "running"
    POST_RUN = "post_run"
    TEARDOWN = "teardown"


class SessionStatus(str, enum.Enum):
    """How a session ended."""

    COMPLETED = "completed"
    TIMEOUT = "timeout"
    ERROR = "error"
    CANCELLED = "cancelled"


class SessionSpec(Event):
    """One session as registered: what runs, against what, and how its data is built."""

    topic: ClassVar[Topic] = Topic.SESSIONS
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["session.spec"] = "session.spec"
    schema_version: Literal[1] = 1
    session_id: str = Field(min_length=1, max_length=128)
    task_id: str | None = None
    sample_index: int = Field(default=0, ge=0)
    origin: Literal["rollout", "adhoc"] = "rollout"
    instruction: str | None = None
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    agent: AgentSpec | None = None
    builder: BuilderName = "prefix_merging"
    evaluator: EvaluatorSpec | None = None
    engine: EngineParams = Field(default_factory=EngineParams)
    timeout_s: float = Field(default=1800.0, gt=0)
    api_key: str | None = Field(default=None, description=(
        "Session-scoped key the harness sends; the proxy maps it to this session."))
    group_id: str | None = None
    policy_version: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    attempt: int = Field(default=0, ge=0, description=(
        "0 for a task's own session; n for the n-th resubmission of its sample after infrastructure failures."))
    retry_of: str | None = Field(default=None, description=(
        "The session this one replaces (same task, same sample_index), which failed for the infrastructure."))


class SessionStageChanged(Event):
    """A session entered a stage of the gateway node pipeline."""

    topic: ClassVar[Topic] = Topic.SESSION_EVENTS
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["session.stage"] = "session.stage"
    schema_version: Literal[1] = 1
    session_id: str
    task_id: str | None = None
    stage: SessionStage
    node: str | None = Field(default=None, description="Gateway node that runs the session.")
    elapsed_s: float | None = Field(default=None, ge=0, description="Seconds spent in the previous stage.")
    detail: str | None = None


class SessionEnded(Event):
    """A session is over: status, whose failure it was, the final patch and the timings."""

    topic: ClassVar[Topic] = Topic.SESSION_EVENTS
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["session.ended"] = "session.ended"
    schema_version: Literal[1] = 1
    session_id: str
    task_id: str | None = None
    status: SessionStatus
    failure: FailureKind | None = None
    cause: Cause | None = Field(default=None, description=(
        "Why it failed, a row of schemas.attribution.RULES (which decides `failure`)."))
    reason: str | None = None
    exit_code: int | None = None
    evidence: Evidence | None = Field(default=None, description="What the cause was decided on.")
    patch: str | None = Field(default=None, description="Final git diff of the workspace.")
    artifacts: dict[str, str] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per stage.")
