"""Completion payloads: the log keeps them, the worker only remembers where they are.

A completion record is 10-50 kB. Copying it into a changelogged table would write it to RocksDB and
send it to Kafka a second time (the changelog), doubling the bytes the broker handles and paying a
compression per record. The ``completions`` topic is already a retained log, so the tables keep one
small :class:`~processors.sessions.CallRef` (partition, offset) per completion, and the bytes live in:

- :class:`PayloadCache`, an in-memory, size-bounded map (partition, offset) -> record value filled as
  records are read. It is derived data: lost on restart, trimmed on rebalance, evicted oldest-first when
  over budget; a record at an offset never changes, so a cached value is never stale.
- the log itself, read back by offset with :class:`LogReader` when the cache misses (after a restart,
  a rebalance, or an eviction): one plain consumer (no group, nothing committed), assign + seek.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

logger = logging.getLogger(__name__)


class LogReadError(RuntimeError):
    """The log could not be read back (broker unreachable, partition unknown)."""


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

    def __init__(self, bootstrap: str, topic: str, *, fetch_bytes: int, timeout_s: float = 30.0) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.fetch_bytes, self.timeout_s = fetch_bytes, timeout_s
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                        auto_offset_reset="earliest", max_partition_fetch_bytes=self.fetch_bytes,
                                        isolation_level="read_uncommitted")
            try:
                await consumer.start()
            except KafkaError as exc:
                raise LogReadError(f"cannot reach Kafka at {self.bootstrap}: {exc!r}") from exc
            self._consumer = consumer
        return self._consumer

    async def read(self, partition: int, offsets: Iterable[int]) -> dict[int, bytes]:
        """The values at ``offsets`` of ``partition``; offsets no longer in the log are absent."""
        wanted = set(offsets)
        found: dict[int, bytes] = {}
        if not wanted:
            return found
        async with self._lock:
            consumer = await self._started()
            tp = TopicPartition(self.topic, partition)
            try:
                consumer.assign([tp])
                start = (await consumer.beginning_offsets([tp]))[tp]
                end = (await consumer.end_offsets([tp]))[tp]
                wanted = {o for o in wanted if start <= o < end}
                if not wanted:
                    return found
                consumer.seek(tp, min(wanted))
                last = max(wanted)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self.timeout_s
                while wanted.difference(found) and loop.time() < deadline:
                    batch = await consumer.getmany(tp, timeout_ms=500)
                    for record in batch.get(tp, ()):
                        if record.offset in wanted and record.value is not None:
                            found[record.offset] = record.value
                    if await consumer.position(tp) > last:
                        break
            except KafkaError as exc:
                raise LogReadError(f"reading {self.topic}[{partition}] back failed: {exc!r}") from exc
        return found

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()
