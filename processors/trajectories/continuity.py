"""Every input record exactly once per assignment: offsets skipped by the stream are read back from the log.

Faust hands the agent each partition's records in offset order, but not always all of them: around a
rebalance its flow control clears the queues of records already fetched (``clear_on_resume``) while the
fetch position stays past them, and records fetched before the seek to the committed offsets are handed
out again after it. Both were seen in a two-worker run (``tests/processors/test_two_workers.py``): a
completion at offset 37 never reached the new owner (its session was built without that call and its
children dead-lettered as having no parent), and records at 38-39 were handled twice. Faust then
commits past a hole as if it were a transaction marker, so a skipped record is lost for good.

:class:`InputContinuity` keeps, per input partition of the current assignment, the next offset the worker
must handle, starting from the group's committed offset (where the partition's previous owner stopped:
everything before it is in the recovered tables). For each record the stream hands out it says:

- ``DUPLICATE``: the offset is below the next one (already handled in this assignment, or before the
  committed offset): skip it, do not handle it twice;
- ``NEXT``: handle it;
- a gap: the offsets between the next one and this record's were not handed out; they are read from the
  log (:class:`RangeReader`) and handled first, in order. A transaction's marker takes an offset that no
  reader sees, so a read-back can come back shorter than the gap, or empty: that is normal and cheap
  (producers here are not transactional, so gaps are rare).

Records handed out while the tables are still being recovered are not handled (their state is not there
yet) and do not move the next offset: the first record after recovery finds the gap and reads them back.
A hole at a partition's end has no later record to reveal it: :meth:`InputContinuity.behind` names the
partitions whose high watermark is past the next offset while the stream has handed out nothing of them
for a while, and the worker reads those ends back itself (a record the stream was only slow to hand out
is then skipped as a repeat when it comes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka import TopicPartition as KafkaTopicPartition

from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings, TransportError
from schemas.transport.consumer import RawRecord, topic_spec

logger = logging.getLogger(__name__)

DUPLICATE = "duplicate"
NEXT = "next"

TopicPartition = tuple[str, int]


@dataclass(slots=True)
class LogRecord:
    """A record read back from the log, with the attributes the aggregator reads (aggregate.Record)."""

    topic: str
    partition: int
    offset: int
    timestamp: float  # seconds, as Faust's Message has it
    key: bytes | None
    value: bytes | None
    headers: Any

    @classmethod
    def of(cls, raw: RawRecord) -> LogRecord:
        return cls(raw.topic, raw.partition, raw.offset, raw.timestamp_ms / 1000, raw.key, raw.value, raw.headers)


@dataclass(frozen=True, slots=True)
class Gap:
    """Offsets ``[start, end)`` of ``topic``/``partition`` that the stream did not hand out."""

    topic: str
    partition: int
    start: int
    end: int


class InputContinuity:
    """The next offset to handle per input partition, for one assignment at a time."""

    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}
        self._starts: dict[TopicPartition, int] = {}
        self._seen_at: dict[TopicPartition, float] = {}  # when the stream last handed out a record of it
        self.baselined = False
        self.counters = {"duplicates_skipped": 0, "gaps": 0, "gap_offsets": 0, "tails_read": 0}

    def reset(self) -> None:
        """Partitions were revoked or assigned: the committed offsets must be asked again."""
        self._next.clear()
        self._starts.clear()
        self._seen_at.clear()
        self.baselined = False

    def baseline(self, committed: Mapping[TopicPartition, int]) -> None:
        """Start each partition at the group's committed offset (or the log's start when none); only the
        first baseline of an assignment counts (a second one would move handled partitions back)."""
        if self.baselined:
            return
        self._next.update(committed)
        self._starts.update(committed)
        self.baselined = True

    def committed(self, topic: str, partition: int) -> int | None:
        """Where this assignment started reading ``topic``/``partition`` (None before the baseline)."""
        return self._starts.get((topic, partition)) if self.baselined else None

    def admit(self, topic: str, partition: int, offset: int, now: float = 0.0) -> str | Gap:
        """Classify a record the stream handed out; call :meth:`handled` once it is handled."""
        self._seen_at[(topic, partition)] = now
        expected = self._next.get((topic, partition))
        if expected is None:
            return NEXT  # not baselined (no committed offset known): trust the stream
        if offset < expected:
            self.counters["duplicates_skipped"] += 1
            return DUPLICATE
        if offset > expected:
            self.counters["gaps"] += 1
            self.counters["gap_offsets"] += offset - expected
            return Gap(topic, partition, expected, offset)
        return NEXT

    def handled(self, topic: str, partition: int, offset: int) -> None:
        key = (topic, partition)
        if key in self._next:
            self._next[key] = max(self._next[key], offset + 1)

    def behind(self, partition: int, highwater: Callable[[str, int], int | None], now: float,
               quiet_s: float, topics: Collection[str]) -> list[Gap]:
        """The ends of ``partition`` of ``topics`` that are on the log but were not handed out, for those
        the stream has been quiet about for ``quiet_s`` (empty before the baseline)."""
        gaps = []
        for (topic, p), expected in self._next.items():
            if p != partition or topic not in topics:
                continue
            end = highwater(topic, p)
            if end is not None and end > expected and now - self._seen_at.get((topic, p), 0.0) >= quiet_s:
                gaps.append(Gap(topic, p, expected, end))
        return gaps

    def partitions_behind(self, highwater: Callable[[str, int], int | None], now: float,
                          quiet_s: float, topics: Collection[str]) -> set[int]:
        """The partitions with an input end to read back (see :meth:`behind`)."""
        return {p for (_, p) in self._next if self.behind(p, highwater, now, quiet_s, topics)}

    def read_to(self, gap: Gap) -> None:
        """``gap`` was read back from the log and handled: its offsets are accounted for (markers too)."""
        self.counters["tails_read"] += 1
        self.handled(gap.topic, gap.partition, gap.end - 1)


class RangeReader:
    """Reads ranges of offsets of the worker's input topics back from the log, and the group's committed
    offsets: one manually assigned consumer per topic (no group, nothing committed), started on first use."""

    def __init__(self, settings: KafkaSettings, like: Mapping[str, Topic], *, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.like = dict(like)  # topic name -> the logical topic whose limits it has
        self.timeout_s = timeout_s
        self._consumers: dict[str, EventConsumer] = {}
        self._lock = asyncio.Lock()

    async def _consumer(self, topic: str) -> EventConsumer:
        consumer = self._consumers.get(topic)
        if consumer is None:
            spec = topic_spec(self.settings, topic, like=self.like.get(topic, Topic.COMPLETIONS))
            # Read as the worker reads (uncommitted too: Faust is at least once, not read-committed).
            consumer = EventConsumer(self.settings, [spec], group_id=None, service="continuity", dead_letters=False,
                                     manual=True, read_committed=False)
            await consumer.start()
            self._consumers[topic] = consumer
        return consumer

    async def read(self, gap: Gap) -> list[LogRecord]:
        """The records in ``gap``, in offset order (markers and records gone from the log are absent)."""
        async with self._lock:
            consumer = await self._consumer(gap.topic)
            tp = consumer_tp(gap.topic, gap.partition)
            consumer.assign([tp])
            start = max(gap.start, (await consumer.beginning_offsets([tp]))[tp])
            if start >= gap.end:
                return []
            consumer.seek(tp, start)
            found: dict[int, LogRecord] = {}
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            while asyncio.get_running_loop().time() < deadline:
                batch = await consumer.getmany_raw(500, partitions=[tp])
                for raw in batch:
                    if gap.start <= raw.offset < gap.end:
                        found[raw.offset] = LogRecord.of(raw)
                if (await consumer.positions()).get(tp, 0) >= gap.end or await consumer.caught_up({tp: gap.end}):
                    break
            return [found[o] for o in sorted(found)]

    async def end_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Where each (topic, partition) ends on the broker now (one request per topic)."""
        by_topic: dict[str, list[int]] = {}
        for topic, partition in partitions:
            by_topic.setdefault(topic, []).append(partition)
        out: dict[tuple[str, int], int] = {}
        async with self._lock:
            for topic, numbers in by_topic.items():
                consumer = await self._consumer(topic)
                ends = await consumer.end_offsets([consumer_tp(topic, p) for p in numbers])
                out.update(((tp.topic, tp.partition), end) for tp, end in ends.items())
        return out

    async def committed(self, group_id: str, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The group's committed offset of each partition; the log's start for one with none."""
        wanted = list(partitions)
        if not wanted:
            return {}
        # A member of the group that never subscribes: it asks the coordinator, without joining.
        probe = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap, group_id=group_id,
                                 enable_auto_commit=False, client_id="rollwire-continuity")
        try:
            await probe.start()
            out: dict[TopicPartition, int] = {}
            tps = [consumer_tp(topic, partition) for topic, partition in wanted]
            starts = await probe.beginning_offsets(tps)
            for tp in tps:
                committed = await probe.committed(tp)
                out[(tp.topic, tp.partition)] = committed if committed is not None else starts[tp]
            return out
        except Exception as exc:  # aiokafka raises several kinds; the caller goes on without a baseline
            raise TransportError(f"reading the committed offsets of {group_id} failed: {exc!r}") from exc
        finally:
            await probe.stop()

    async def stop(self) -> None:
        consumers, self._consumers = list(self._consumers.values()), {}
        for consumer in consumers:
            await consumer.stop()


def consumer_tp(topic: str, partition: int) -> KafkaTopicPartition:
    return KafkaTopicPartition(topic, partition)
