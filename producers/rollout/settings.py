"""Rollout server settings, read from the environment (``ROLLWIRE_ROLLOUT_*``).

Kafka itself comes from :class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``); these are the server's
own knobs.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import paths


def _default_state_dir() -> Path:
    return paths.home() / "rollout-server"


class RolloutServerSettings(BaseSettings):
    """The rollout server's own knobs. Every field reads ``ROLLWIRE_ROLLOUT_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_ROLLOUT_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Where the rollout server listens.")
    port: int = Field(default=18090, description="The rollout server's port.")
    public_url: str | None = Field(default=None, description="Its base URL for clients, if not host:port.")
    state_dir: Path = Field(default_factory=_default_state_dir, description=(
        "The record of callbacks already delivered, the only state that is not on Kafka. Default: "
        "$ROLLWIRE_HOME/rollout-server."))
    callback_attempts: int = Field(default=8, ge=1, description="Attempts to deliver a task's result to its callback URL.")
    callback_backoff_s: float = Field(default=1.0, gt=0, description=(
        "First wait between callback attempts, doubled per attempt (with jitter)."))
    callback_max_backoff_s: float = Field(default=60.0, gt=0, description="Longest wait between callback attempts.")
    callback_timeout_s: float = Field(default=10.0, gt=0, description="Longest wait for one callback attempt.")
    evaluation_wait_s: float = Field(default=600.0, ge=0, description=(
        "How long after its last session ended a task waits for missing evaluations before its result goes "
        "out marked incomplete."))
    count_completions: bool = Field(default=True, description=(
        "Count each session's records on `completions` (reads the completion log, keys only)."))
    max_retries: int = Field(default=2, ge=0, le=10, description=(
        "How many times a sample whose session failed for the infrastructure is resubmitted, for tasks that "
        "do not say (TaskRequest.max_retries)."))

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"
