"""Rollout server settings, read from the environment (``ROLLWIRE_ROLLOUT_*``).

Kafka itself comes from :class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``); these are the server's
own knobs.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_state_dir() -> Path:
    return Path(os.environ.get("ROLLWIRE_HOME") or "~/.rollwire").expanduser() / "rollout-server"


class RolloutServerSettings(BaseSettings):
    """Every field reads ``ROLLWIRE_ROLLOUT_<FIELD>``.

    ``HOST``/``PORT`` (127.0.0.1:18090): where the server listens. ``PUBLIC_URL``: its base URL for
    clients, if not host:port. ``STATE_DIR`` ($ROLLWIRE_HOME/rollout-server): the record of callbacks
    already delivered (the only state that is not on Kafka). ``CALLBACK_ATTEMPTS`` (8),
    ``CALLBACK_BACKOFF_S`` (1.0, doubled per attempt up to ``CALLBACK_MAX_BACKOFF_S``, 60),
    ``CALLBACK_TIMEOUT_S`` (10): delivery of results to callback URLs. ``EVALUATION_WAIT_S`` (600): how
    long after its last session ended a task waits for missing evaluations before its result goes out
    marked incomplete. ``COUNT_COMPLETIONS`` (true): count each session's records on `completions`
    (reads the completion log, keys only).
    """

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_ROLLOUT_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 18090
    public_url: str | None = None
    state_dir: Path = Field(default_factory=_default_state_dir)
    callback_attempts: int = Field(default=8, ge=1)
    callback_backoff_s: float = Field(default=1.0, gt=0)
    callback_max_backoff_s: float = Field(default=60.0, gt=0)
    callback_timeout_s: float = Field(default=10.0, gt=0)
    evaluation_wait_s: float = Field(default=600.0, ge=0)
    count_completions: bool = True

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"
