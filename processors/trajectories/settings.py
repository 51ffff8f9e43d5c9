"""The trajectory worker's settings, read from the environment (``ROLLWIRE_PROCESSORS_*``).

Kafka itself (bootstrap, topic prefix, partition counts, size limits) comes from
:class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``); the fields every Faust worker has come from
:class:`processors.worker.settings.FaustWorkerSettings`; these are the trajectory worker's own knobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from processors.worker.settings import FaustWorkerSettings, home_data_dir, worker_default


class ProcessorSettings(FaustWorkerSettings):
    """Every field reads ``ROLLWIRE_PROCESSORS_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_PROCESSORS_", extra="ignore")

    app_id: str = worker_default("app_id", default="processors")
    data_dir: Path = worker_default("data_dir", default_factory=lambda: home_data_dir("processors"))
    port: int = worker_default("port", default=18081)
    idle_s: float = Field(default=600.0, gt=0,
                          description="A session with no spec and no event for this long is built as partial (one "
                                      "with a spec: at its timeout_s plus GRACE_S).")
    grace_s: float = Field(default=30.0, ge=0,
                           description="Added to a spec's timeout_s before the session is built as partial, and the "
                                       "least time after a (re)start before any deadline fires (so a replay can "
                                       "catch up first).")
    cache_mb: int = Field(default=512, ge=0,
                          description="Memory for the completion payloads of open sessions; beyond it (and after a "
                                      "restart) they are read back from the completions log when the session is "
                                      "built.")
    compression: Literal["snappy", "zstd", "gzip", "lz4", "none"] = Field(
        default="snappy", description="Compression of the worker's producer (trajectories, changelogs, control "
                                      "records). snappy costs less CPU than zstd for somewhat more bytes, which "
                                      "suits a CPU-bound worker (bench.pipeline measures the worker's CPU).")
    batch_records: int = Field(default=1000, ge=1,
                               description="Table writes are held in memory and flushed every this many records or "
                                           "BATCH_MS, whichever comes first; records are acknowledged only after the "
                                           "flush that covers them, so at most this much is read again after a "
                                           "crash.")
    batch_ms: float = Field(default=1000.0, gt=0,
                            description="The flush interval of the held table writes (see BATCH_RECORDS): a "
                                        "session's records between two flushes cost one table write; shorter "
                                        "intervals cost the worker more CPU per completion (bench.pipeline).")
    build_processes: int = Field(default=1, ge=0, le=64,
                                 description="Processes that build sessions (validate their records, resolve prompt "
                                             "deltas, run the builder, encode the trajectory) while the worker goes "
                                             "on reading records; 0 builds on the worker's own event loop.")
    transport_only: bool = Field(default=False,
                                 description="Benchmarks only: count and acknowledge records without handling them, "
                                             "to measure what the Faust transport alone costs (bench.pipeline).")
    tick_s: float = Field(default=0.5, gt=0, description="How often the deadline timer looks at open sessions.")
    settle_s: float = Field(default=1.0, ge=0,
                            description="How long after a (re)start a partition that delivered nothing counts as "
                                        "caught up.")
    clock_skew_s: float = Field(default=0.05, ge=0,
                                description="How far the clocks of the machines that write a session's records "
                                            "(proxies, gateways) may disagree: a session counts as read up to its "
                                            "end once a record stamped more than this after the end was handled on "
                                            "each other input, or once each is handled up to an end asked from the "
                                            "broker after the end was handled (processors.trajectories.progress).")
