"""The groups worker's settings, read from the environment (``ROLLWIRE_GROUPS_*``).

Kafka itself (bootstrap, topic prefix, partition counts, size limits) comes from
:class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``); the fields every Faust worker has come from
:class:`processors.worker.settings.FaustWorkerSettings`; these are the groups worker's own knobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from processors.worker.settings import FaustWorkerSettings, home_data_dir, worker_default


class GroupSettings(FaustWorkerSettings):
    """Every field reads ``ROLLWIRE_GROUPS_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_GROUPS_", extra="ignore")

    app_id: str = worker_default("app_id", default="groups")
    data_dir: Path = worker_default("data_dir", default_factory=lambda: home_data_dir("groups"))
    port: int = worker_default("port", default=18082)
    estimator: Literal["grpo", "leave_one_out"] = Field(default="grpo", description="The advantage estimator: "
                                                                                    "grpo or leave_one_out.")
    eps: float = Field(default=1e-6, ge=0, description="GRPO's epsilon added to the group's reward std.")
    evaluator: str = Field(default="session_completed",
                           description="Whose rewards a group uses when its task names no evaluator.")
    grace_s: float = Field(default=300.0, ge=0,
                           description="A task's deadline is its acceptance time plus its timeout_s plus this.")
    min_fraction: float = Field(default=0.5, ge=0, le=1,
                                description="At the deadline, the group is emitted (complete: false) if at least "
                                            "this fraction of its samples is in; otherwise the worker keeps waiting "
                                            "until ABANDON_S after the deadline.")
    abandon_s: float = Field(default=3600.0, ge=0,
                             description="How long after its deadline a task whose group is still short of "
                                         "MIN_FRACTION is dropped.")
    min_usable: float = Field(default=0.5, ge=0, le=1,
                              description="A group in which fewer than this share of the samples are usable "
                                          "(scored, or failed by the policy: not infrastructure, not unknown, after "
                                          "resubmissions) is emitted marked insufficient, and the trainer feed "
                                          "leaves it out.")
    tick_s: float = Field(default=1.0, gt=0, description="How often the deadline timer looks at open tasks.")
