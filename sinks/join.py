"""The trainer feed's join of groups to their trajectories: a bounded index fed by tailing `trajectories`.

A `groups` event names each sample's trajectory by event id; the trajectory itself (its token ids, loss
mask and logprobs) is on `trajectories`, written before the group. Decision: the feed tails the
trajectories topic itself (no consumer group, every partition assigned) into an in-memory index keyed by
trajectory event id, bounded by bytes (oldest evicted first), instead of reading each trajectory back by
offset: a group does not carry its trajectories' offsets, and a tail reads each record once, in order.

Where the tail starts: ``lookback_s`` before the timestamp of the first group the feed reads (a resumed
trainer does not re-read the whole log), or the beginning of the topic when ``lookback_s`` is None. When a
group names a trajectory the index lacks, :meth:`TrajectoryJoin.resolve` reads the tail up to the current
end of the topic; if that is not enough and the tail did not start at the beginning (or evicted anything),
it rescans the topic from the beginning for just the missing ids; then it keeps tailing until
``timeout_s`` has passed. A trajectory still missing then is reported missing (the feed skips that sample
and counts it) rather than blocking the trainer forever.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from aiokafka import TopicPartition

from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, RawRecord, Received, TransportError, topic_spec
from schemas.transport.settings import KafkaSettings

logger = logging.getLogger(__name__)

DEFAULT_INDEX_BYTES = 2 * 1024 ** 3


@dataclass(frozen=True, slots=True)
class IndexedTrace:
    """The arrays of one trace, as the feed needs them, and its branch role (the feed keeps some roles)."""

    trace_id: str
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    role: str = "main"

    @property
    def nbytes(self) -> int:
        return self.token_ids.nbytes + self.loss_mask.nbytes + self.logprobs.nbytes


@dataclass(frozen=True, slots=True)
class IndexedTrajectory:
    """A trajectory reduced to what a training batch needs."""

    trajectory_id: str
    session_id: str
    task_id: str | None
    traces: tuple[IndexedTrace, ...]

    @classmethod
    def of(cls, trajectory: Trajectory) -> IndexedTrajectory:
        traces = tuple(IndexedTrace(t.trace_id, t.token_ids.numpy, t.loss_mask.numpy, t.logprobs.numpy, t.role)
                       for t in trajectory.traces)
        return cls(trajectory.event_id, trajectory.session_id, trajectory.task_id, traces)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.traces) + 256


class TrajectoryIndex:
    """Trajectories by event id, at most ``max_bytes`` of arrays, oldest evicted first."""

    def __init__(self, max_bytes: int = DEFAULT_INDEX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evicted = 0
        self._items: OrderedDict[str, IndexedTrajectory] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._items

    def get(self, trajectory_id: str) -> IndexedTrajectory | None:
        return self._items.get(trajectory_id)

    def add(self, trajectory: IndexedTrajectory) -> None:
        if trajectory.trajectory_id in self._items:
            return
        self._items[trajectory.trajectory_id] = trajectory
        self.bytes += trajectory.nbytes
        while self.bytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1


class TrajectoryJoin:
    """Tails a trajectories topic into a :class:`TrajectoryIndex` and resolves trajectory ids on demand."""

    def __init__(self, settings: KafkaSettings, topic: str, *, lookback_s: float | None = 3600.0,
                 index_bytes: int = DEFAULT_INDEX_BYTES, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.topic = topic
        self.lookback_s = lookback_s
        self.timeout_s = timeout_s
        self.index = TrajectoryIndex(index_bytes)
        self._spec = topic_spec(settings, topic, like=Topic.TRAJECTORIES)
        self._consumer: EventConsumer | None = None
        self._partitions: list[TopicPartition] = []
        self._from_beginning = lookback_s is None
        self._rescanned: set[str] = set()

    def _new_consumer(self) -> EventConsumer:
        # Without a consumer group: every partition of the topic is assigned. The feed is a reader of this
        # topic, not its processor: a record that is not a trajectory is skipped (its processor's group
        # dead-letters it). No deduplication: the index keeps one copy per id, and a copy read again after
        # its eviction is wanted.
        return EventConsumer(self.settings, [self._spec], group_id=None, service="feed-join", dead_letters=False,
                             dedupe_window=0)

    async def start(self, first_timestamp_ms: int | None) -> None:
        """Assign every partition and seek to where the tail starts (see the module docstring)."""
        if self._consumer is not None:
            return
        consumer = self._new_consumer()
        await consumer.start()
        self._consumer = consumer
        self._partitions = await self._assign(consumer)
        if self.lookback_s is None or first_timestamp_ms is None:
            await consumer.seek_to_beginning(self._partitions)
            self._from_beginning = True
            return
        await consumer.seek_to_time(max(0, first_timestamp_ms - int(self.lookback_s * 1000)), self._partitions)

    async def _assign(self, consumer: EventConsumer) -> list[TopicPartition]:
        """Wait until the consumer (without a group) is assigned every partition of the topic."""
        try:
            return await consumer.wait_for_assignment(timeout_s=30)
        except TransportError as exc:
            raise LookupError(f"topic {self.topic!r} has no partitions on {self.settings.kafka_bootstrap}") from exc

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    def _index(self, received: Received | None) -> bool:
        if received is None:
            return False
        if not isinstance(received.event, Trajectory):  # the topic's spec admits nothing else
            return False
        self.index.add(IndexedTrajectory.of(received.event))
        return True

    async def _poll(self, timeout_ms: int) -> int:
        assert self._consumer is not None
        return sum(self._index(received) for received in await self._consumer.getmany(timeout_ms=timeout_ms))

    async def resolve(self, trajectory_ids: Iterable[str]) -> dict[str, IndexedTrajectory]:
        """The indexed trajectories for these ids; an id missing from the result was not found in time."""
        assert self._consumer is not None, "start() first"
        wanted = set(trajectory_ids)
        missing = {t for t in wanted if t not in self.index}
        if missing:
            ends = await self._consumer.end_offsets(self._partitions)
            while missing and not await self._consumer.caught_up(ends):
                await self._poll(200)
                missing = {t for t in missing if t not in self.index}
        if missing and (not self._from_beginning or self.index.evicted) and not missing <= self._rescanned:
            await self._rescan(missing)
            self._rescanned |= missing
            missing = {t for t in missing if t not in self.index}
        deadline = time.monotonic() + self.timeout_s
        while missing and time.monotonic() < deadline:
            await self._poll(200)
            missing = {t for t in missing if t not in self.index}
        return {t: found for t in wanted if (found := self.index.get(t)) is not None}

    async def _rescan(self, missing: set[str]) -> None:
        """Read the topic from the beginning to its current end, indexing only the missing ids (records that
        do not even contain one of the ids are passed over undecoded)."""
        logger.info("rescanning %s from the beginning for %d trajectories", self.topic, len(missing))
        async with self._new_consumer() as consumer:
            partitions = await self._assign(consumer)
            await consumer.seek_to_beginning(partitions)
            ends = await consumer.end_offsets(partitions)
            while not await consumer.caught_up(ends):
                for record in await consumer.getmany_raw(timeout_ms=500):
                    if self._may_hold(record, missing):
                        received = await consumer.take(record)
                        if received is not None and received.event.event_id in missing:
                            self._index(received)

    @staticmethod
    def _may_hold(record: RawRecord, missing: set[str]) -> bool:
        return bool(missing and record.value and any(m.encode() in record.value for m in missing))
