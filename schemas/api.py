"""HTTP API models shared between services and their callers (the proxy's session API)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from schemas.envelope import Model
from schemas.sessions import SessionStatus
from schemas.tasks import AgentSpec, BuilderName, EngineParams


class SessionCreate(Model):
    """POST /v1/sessions: register an ad-hoc session, e.g. to record a harness run by hand."""

    session_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    api_key: str | None = Field(default=None, min_length=8, max_length=256)
    task_id: str | None = None
    agent: AgentSpec | None = None
    builder: BuilderName = "prefix_merging"
    engine: EngineParams = Field(default_factory=EngineParams)
    policy_version: str | None = None
    timeout_s: float = Field(default=86400.0, gt=0)
    metadata: dict[str, Any] = Field(default_factory=dict)


class SessionCreated(Model):
    """The registered session and the base URLs a harness points at."""

    session_id: str
    api_key: str
    base_urls: dict[str, str] = Field(description="Per provider API: the base URL to configure in the harness.")


class SessionEnd(Model):
    """POST /v1/sessions/{id}/end: close a session (its calls are refused afterwards)."""

    status: SessionStatus = SessionStatus.COMPLETED
    reason: str | None = None


class SessionState(Model):
    """GET /v1/sessions/{id}."""

    session_id: str
    live: bool
    calls: int
    origin: str


class WeightUpdate(Model):
    """POST /v1/policy/weights on the proxy: load new weights into the running engine, no restart.

    The proxy holds new calls, lets the calls in flight finish on the current weights, has the engine load
    ``weights_path`` (a Hugging Face checkpoint folder the engine can read: safetensors and config), sets
    the engine's weight version to ``version``, and lets the held calls go."""

    weights_path: str = Field(min_length=1, description="Checkpoint folder, as the engine's host sees it.")
    version: str = Field(pattern=r"^v?\d{1,18}$", description="The new policy version, a whole number (or v7).")
    drain_timeout_s: float = Field(default=600.0, gt=0, description=(
        "How long to wait for calls in flight to finish on the old weights before the update fails."))


class PolicyState(Model):
    """GET /v1/policy on the proxy, and the answer to a weight update."""

    served_model: str | None = None
    version: str = Field(description="The engine's current weight version.")
    updating: bool = False
    holding: bool = Field(default=False, description=(
        "New calls are held now: the update is past its checks and has closed the gate (draining the calls "
        "in flight, or loading)."))
    updates: int = Field(default=0, ge=0, description="Weight updates this proxy coordinated.")
    last_paused_ms: float | None = None
    held_calls: int = Field(default=0, ge=0, description="Calls waiting now for an update to finish.")
    tier: list[str] = Field(default_factory=list, description=(
        "The proxy processes of the tier this one hears from (itself included): an update waits for their drains."))
