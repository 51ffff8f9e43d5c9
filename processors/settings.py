"""The processors worker's settings, read from the environment (``ROLLWIRE_PROCESSORS_*``).

Kafka itself (bootstrap, topic prefix, partition counts, size limits) comes from
:class:`schemas.transport.KafkaSettings` (``ROLLWIRE_*``); these are the worker's own knobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    import os

    return Path(os.environ.get("ROLLWIRE_HOME") or "~/.rollwire").expanduser() / "processors" / "data"


class ProcessorSettings(BaseSettings):
    """Every field reads ``ROLLWIRE_PROCESSORS_<FIELD>``.

    ``APP_ID`` (``processors``): Faust app id = consumer group and changelog topic prefix (the
    topic prefix is added in front, so two deployments on one cluster never share state).
    ``STORE`` (``rocksdb``): table store, ``rocksdb`` (rocksdict) or ``memory`` (state rebuilt from the
    changelogs at every start). ``DATA_DIR``: where RocksDB keeps the tables.
    ``IDLE_S`` (600): a session with no spec and no event for this long is built as partial (one with a
    spec: at its ``timeout_s`` plus ``GRACE_S``).
    ``GRACE_S`` (30): added to a spec's ``timeout_s`` before the session is built as partial, and the
    least time after a (re)start before any deadline fires (so a replay can catch up first).
    ``CACHE_MB`` (512): memory for completion payloads of open sessions; beyond it (and after a restart)
    they are read back from the ``completions`` log when the session is built.
    ``COMPRESSION`` (``snappy``): the worker's producer (trajectories, changelogs, control records):
    ``snappy``, ``zstd``, ``gzip``, ``lz4`` or ``none``. snappy costs about a sixth of zstd's CPU on a
    trajectory (0.2 vs 1.4 ms for 49 kB, for 1.5x the bytes); on a CPU-bound worker that matters more.
    ``BATCH_RECORDS`` (1000) / ``BATCH_MS`` (1000): table writes are held in memory and flushed every this
    many records or milliseconds, whichever comes first (records are acknowledged only after the flush
    that covers them, so at most this much is read again after a crash); a session's records between two
    flushes cost one table write (a RocksDB put and a changelog record). At 200 ms a session of a flood
    was written in two or three flushes; the worker's loop spent about 10% more CPU per completion
    (bench.pipeline). Faust commits offsets once a second (``broker_commit_interval``) in any case.
    ``TRANSPORT_ONLY`` (false): benchmarks only: count and acknowledge records without handling them,
    to measure what the Faust transport alone costs on the same machine (``bench.pipeline`` does).
    ``BUILD_PROCESSES`` (1): processes that build sessions (validate their records, resolve prompt deltas,
    run the builder, encode the trajectory) while the worker goes on reading records; 0 builds on the
    worker's own event loop, between records.
    ``TICK_S`` (0.5): how often the deadline timer looks at open sessions.
    ``SETTLE_S`` (1.0): how long after a (re)start a partition that delivered nothing counts as caught up.
    ``CLOCK_SKEW_S`` (0.05): how far the clocks of the machines that write a session's records (proxies,
    gateways) may disagree. A session counts as read up to its end once a record stamped more than this
    after the end was handled on each other input, or once everything up to an end asked from the broker
    after the end was handled is (processors.progress).
    ``SESSION_TIMEOUT_S`` (30): consumer group session timeout; a worker that died without leaving the
    group holds its partitions this long before a restarted or other worker gets them.
    ``HOST``/``PORT`` (127.0.0.1:18081): the worker's ``/health`` endpoint.
    ``LOG_LEVEL`` (``info``).
    ``EVENT_LOOP`` (``uvloop``): the worker's event loop, ``uvloop`` or ``asyncio`` (the standard library's;
    see processors.faust_worker.run_worker).
    """

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_PROCESSORS_", extra="ignore")

    app_id: str = "processors"
    store: Literal["rocksdb", "memory"] = "rocksdb"
    data_dir: Path = Field(default_factory=_default_data_dir)
    idle_s: float = Field(default=600.0, gt=0)
    grace_s: float = Field(default=30.0, ge=0)
    cache_mb: int = Field(default=512, ge=0)
    compression: Literal["snappy", "zstd", "gzip", "lz4", "none"] = "snappy"
    batch_records: int = Field(default=1000, ge=1)
    batch_ms: float = Field(default=1000.0, gt=0)
    build_processes: int = Field(default=1, ge=0, le=64)
    transport_only: bool = False
    tick_s: float = Field(default=0.5, gt=0)
    settle_s: float = Field(default=1.0, ge=0)
    clock_skew_s: float = Field(default=0.05, ge=0)
    session_timeout_s: float = Field(default=30.0, ge=6)
    host: str = "127.0.0.1"
    port: int = 18081
    log_level: str = "info"
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
