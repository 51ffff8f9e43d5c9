"""What every Faust worker reads from its own environment prefix: app id, tables, group membership, health.

:class:`FaustWorkerSettings` holds the fields the trajectory worker (``ROLLWIRE_PROCESSORS_*``) and the
groups worker (``ROLLWIRE_GROUPS_*``) both have; each worker's settings class subclasses it, sets its env
prefix and the defaults that differ (app id, data folder, port), and adds its own knobs. Kafka itself
comes from :class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import paths

EventLoop = Literal["uvloop", "asyncio"]


def home_data_dir(worker: str) -> Path:
    """``<ROLLWIRE_HOME>/<worker>/data`` (schemas.paths.home)."""
    return paths.home() / worker / "data"


class FaustWorkerSettings(BaseSettings):
    """The settings every Faust worker has; a subclass sets the env prefix and its own defaults."""

    model_config = SettingsConfigDict(extra="ignore")

    app_id: str = Field(description="Faust app id: the consumer group and the prefix of the worker's own topics "
                                    "(the deployment's topic prefix is added in front, so two deployments on "
                                    "one cluster never share state).")
    store: Literal["rocksdb", "memory"] = Field(
        default="rocksdb", description="Table store: rocksdb (rocksdict) or memory (state rebuilt from the "
                                       "changelogs at every start).")
    data_dir: Path = Field(description="Where RocksDB keeps the tables (under one folder per Kafka cluster and "
                                       "one per app id).")
    session_timeout_s: float = Field(
        default=30.0, ge=6, description="Consumer group session timeout: a worker that died without leaving the "
                                        "group holds its partitions this long before another worker gets them.")
    host: str = Field(default="127.0.0.1", description="Address of the worker's /health endpoint.")
    port: int = Field(description="Port of the worker's /health endpoint.")
    log_level: str = Field(default="info", description="Log level of the worker (Faust's and ours).")
    event_loop: EventLoop = Field(
        default="uvloop", description="The worker's event loop: uvloop (libuv's; Faust's consumer thread gets "
                                      "one too) or asyncio (the standard library's); bench.pipeline "
                                      "--asyncio-loop-too compares the two.")


def worker_default(name: str, **default: Any) -> Any:
    """A subclass's own default (``default=`` or ``default_factory=``) for the base's field ``name``, with the
    base's description."""
    return Field(**default, description=FaustWorkerSettings.model_fields[name].description)
