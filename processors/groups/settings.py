"""The groups worker's settings, read from the environment (``ROLLWIRE_GROUPS_*``).

Kafka itself (bootstrap, topic prefix, partition counts, size limits) comes from
:class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``); these are the worker's own knobs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    return Path(os.environ.get("ROLLWIRE_HOME") or "~/.rollwire").expanduser() / "groups" / "data"


class GroupSettings(BaseSettings):
    """Every field reads ``ROLLWIRE_GROUPS_<FIELD>``.

    ``APP_ID`` (``groups``): Faust app id = consumer group, changelog and by-task topic prefix (the topic
    prefix is added in front). ``STORE`` (``rocksdb``) and ``DATA_DIR``: where the task table lives.
    ``ESTIMATOR`` (``grpo``): ``grpo`` or ``leave_one_out``. ``EPS`` (1e-6): GRPO's std epsilon.
    ``EVALUATOR`` (``session_completed``): whose rewards a group uses when its task names no evaluator.
    ``GRACE_S`` (300): a task's deadline is its acceptance time plus its ``timeout_s`` plus this.
    ``MIN_FRACTION`` (0.5): at the deadline, the group is emitted (``complete: false``) if at least this
    fraction of its samples is in; otherwise the worker keeps waiting, and drops the task ``ABANDON_S``
    (3600) after the deadline. ``TICK_S`` (1.0): how often the deadline timer looks at open tasks.
    ``SESSION_TIMEOUT_S`` (30): consumer group session timeout. ``HOST``/``PORT`` (127.0.0.1:18082):
    the worker's ``/health`` endpoint. ``LOG_LEVEL`` (``info``). ``EVENT_LOOP`` (``uvloop``): the worker's event
    loop, ``uvloop`` or ``asyncio`` (see processors.faust_worker.run_worker).
    """

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_GROUPS_", extra="ignore")

    app_id: str = "groups"
    store: Literal["rocksdb", "memory"] = "rocksdb"
    data_dir: Path = Field(default_factory=_default_data_dir)
    estimator: Literal["grpo", "leave_one_out"] = "grpo"
    eps: float = Field(default=1e-6, ge=0)
    evaluator: str = "session_completed"
    grace_s: float = Field(default=300.0, ge=0)
    min_fraction: float = Field(default=0.5, ge=0, le=1)
    abandon_s: float = Field(default=3600.0, ge=0)
    tick_s: float = Field(default=1.0, gt=0)
    session_timeout_s: float = Field(default=30.0, ge=6)
    host: str = "127.0.0.1"
    port: int = 18082
    log_level: str = "info"
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
