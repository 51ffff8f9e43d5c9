"""Completion payloads: the log keeps them, the worker only remembers where they are.

A completion record is 10-50 kB. Copying it into a changelogged table would write it to RocksDB and
send it to Kafka a second time (the changelog), doubling the bytes the broker handles and paying a
compression per record. The ``completions`` topic is already a retained log, so the tables keep one
small :class:`~processors.trajectories.open_sessions.CallRef` (partition, offset) per completion, and the bytes live in:

- :class:`PayloadCache`, an in-memory, size-bounded map (partition, offset) -> record value filled as
  records are read. It is derived data: lost on restart, trimmed on rebalance, evicted oldest-first when
  over budget; a record at an offset never changes, so a cached value is never stale.
- the log itself, read back by offset with :class:`LogReader` when the cache misses (after a restart,
  a rebalance, or an eviction): one manually assigned EventConsumer (no group, nothing committed) that
  returns the record values undecoded (the aggregator validates them when it builds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable

from aiokafka import TopicPartition

from processors.errors import LogReadError
from schemas.topics import FRAMING_BYTES, Topic
from schemas.transport import EventConsumer, KafkaSettings, TransportError, topic_spec

logger = logging.getLogger(__name__)


class PayloadCache:
    """(partition, offset) -> record value, bounded by ``max_bytes`` (oldest entries evicted first)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._values: dict[tuple[int, int], bytes] = {}  # insertion order = age
        self.hits = self.misses = self.evicted = 0

    def __len__(self) -> int:
        return len(self._values)

    def put(self, partition: int, offset: int, value: bytes) -> None:
        key = (partition, offset)
        if key in self._values or len(value) > self.max_bytes:
            return
        self._values[key] = value
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._values))
            self.bytes -= len(self._values.pop(oldest))
            self.evicted += 1

    def get(self, partition: int, offset: int) -> bytes | None:
        value = self._values.get((partition, offset))
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def discard(self, partition: int, offset: int) -> None:
        value = self._values.pop((partition, offset), None)
        if value is not None:
            self.bytes -= len(value)

    def retain(self, partitions: Collection[int]) -> None:
        """Drop every entry of a partition not in ``partitions`` (they were revoked)."""
        for key in [k for k in self._values if k[0] not in partitions]:
            self.bytes -= len(self._values.pop(key))


class LogReader:
    """Reads records of one topic back by (partition, offset), for cache misses."""

    def __init__(self, bootstrap: str, topic: str, *, fetch_bytes: int, timeout_s: float = 30.0,
                 settings: KafkaSettings | None = None) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.fetch_bytes, self.timeout_s = fetch_bytes, timeout_s
        # The fetch size is one largest record plus its framing: the settings' size limit, given back.
        self.settings = (settings or KafkaSettings()).model_copy(
            update={"kafka_bootstrap": bootstrap, "max_message_bytes": fetch_bytes - FRAMING_BYTES})
        self._consumer: EventConsumer | None = None
        self._lock = asyncio.Lock()

    async def _started(self) -> EventConsumer:
        if self._consumer is None:
            # The worker (Faust, at least once) reads uncommitted records, so an offset it remembers may lie
            # past the last stable offset: read them back the same way.
            spec = topic_spec(self.settings, self.topic, like=Topic.COMPLETIONS)
            consumer = EventConsumer(self.settings, [spec], group_id=None, service="payloads", dead_letters=False,
                                     manual=True, read_committed=False)
            try:
                await consumer.start()
            except TransportError as exc:
                raise LogReadError(f"cannot reach Kafka at {self.bootstrap}: {exc}") from exc
            self._consumer = consumer
        return self._consumer

    async def read(self, partition: int, offsets: Iterable[int]) -> dict[int, bytes]:
        """The values at ``offsets`` of ``partition``; offsets no longer in the log (below its start: removed
        by retention) are absent. Raises :class:`LogReadError` when an offset at or past the log's start is
        not read: every offset asked for is one the worker saw there, so it is in the log, only not readable
        now (its leader gone while a broker fails, or not fetched within ``timeout_s`` on a loaded broker).
        Taken for absent, such offsets built a session without those calls: in the failover test, a
        worker taking a killed worker's sessions over may read them back while a broker is away."""
        wanted = set(offsets)
        if not wanted:
            return {}
        async with self._lock:
            consumer = await self._started()
            try:
                found = await consumer.read_values(partition, wanted, timeout_s=self.timeout_s)
                missing = wanted.difference(found)
                if not missing:
                    return found
                tp = TopicPartition(self.topic, partition)
                start = (await consumer.beginning_offsets([tp]))[tp]
            except TransportError as exc:
                raise LogReadError(f"reading {self.topic}[{partition}] back failed: {exc}") from exc
        unreadable = sorted(o for o in missing if o >= start)
        if unreadable:
            raise LogReadError(f"offsets {_span(unreadable)} of {self.topic}[{partition}] are in the log (it starts "
                               f"at {start}) but could not be read within {self.timeout_s:g} s")
        return found

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()


def _span(offsets: list[int]) -> str:
    """A short form of sorted offsets for messages: ``7``, ``7-9`` or ``7, 9, 12 (3)``."""
    if len(offsets) == 1:
        return str(offsets[0])
    if offsets[-1] - offsets[0] == len(offsets) - 1:
        return f"{offsets[0]}-{offsets[-1]}"
    head = ", ".join(str(o) for o in offsets[:3])
    return f"{head}{', ...' if len(offsets) > 3 else ''} ({len(offsets)})"
