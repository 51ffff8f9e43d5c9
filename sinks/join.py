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

The reverse join, for a feed that reads `trajectories` (:class:`OutcomeJoin`): a trajectory names its
session, and the session's reward is on `evaluations` and its advantage on `groups`, both usually written
*after* the trajectory (the evaluator scores the ended session; the group waits for all its samples). The
feed tails both topics the same way (no consumer group, every partition, from ``lookback_s`` before the
first trajectory it reads) into a :class:`OutcomeIndex` keyed by session id, bounded by a number of
sessions (oldest evicted first). The tail also says how far it is known to be complete
(:attr:`OutcomeJoin.known_until`: it has read everything that was on both topics at that moment), so the
feed takes a trajectory's outcome only once the tail has read what was written before the trajectory was
read: a reward and a group already on the log are always joined, whatever order the partitions are
fetched in. The feed waits for a trajectory's reward at most its ``reward_wait_s`` and then yields it
without one; it never waits for the advantage (a group comes only once every sample of the task is in):
the advantage is attached when the group was read by then.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from aiokafka import TopicPartition

from schemas.evaluations import Evaluation
from schemas.groups import Group
from schemas.policy import PolicyRange
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, RawRecord, Received, TransportError, topic_spec
from schemas.transport.settings import KafkaSettings

logger = logging.getLogger(__name__)

DEFAULT_INDEX_BYTES = 2 * 1024 ** 3
DEFAULT_OUTCOME_SESSIONS = 1_000_000  # a few hundred bytes each


async def seek_to_time(consumer: EventConsumer, partitions: list[TopicPartition], timestamp_ms: int) -> None:
    """Read each partition from its first record at or after ``timestamp_ms``, and a partition without one
    from its end *as it was before the seek*: the consumer's own "seek to the end" is resolved later, at
    its next fetch, and would pass over a record written in between (a reward written just after the
    trajectory was read, never joined)."""
    ends = await consumer.end_offsets(partitions)
    await consumer.seek_to_time(timestamp_ms, partitions)
    for tp, position in (await consumer.positions()).items():
        if tp in ends and position > ends[tp]:
            consumer.seek(tp, ends[tp])


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
    """A trajectory reduced to what a training batch needs: its traces, the range of weight versions it
    was sampled under, and whether its session failed for the infrastructure's sake."""

    trajectory_id: str
    session_id: str
    task_id: str | None
    traces: tuple[IndexedTrace, ...]
    policy_versions: PolicyRange | None = None
    failure: str | None = None

    @classmethod
    def of(cls, trajectory: Trajectory) -> IndexedTrajectory:
        traces = tuple(IndexedTrace(t.trace_id, t.token_ids.numpy, t.loss_mask.numpy, t.logprobs.numpy, t.role)
                       for t in trajectory.traces)
        failure = trajectory.failure.value if trajectory.failure is not None else None
        return cls(trajectory.event_id, trajectory.session_id, trajectory.task_id, traces,
                   trajectory.policy_versions, failure)

    @property
    def oldest_version(self) -> int | None:
        return self.policy_versions.oldest if self.policy_versions is not None else None

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
        await seek_to_time(consumer, self._partitions, max(0, first_timestamp_ms - int(self.lookback_s * 1000)))

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


# -- the reverse join: sessions' rewards and advantages, for a feed that reads trajectories ----------------

@dataclass(slots=True)
class SessionOutcome:
    """What is known of one session's reward (per evaluator) and of its sample in the task's group."""

    rewards: dict[str, float | None] = field(default_factory=dict)  # evaluator -> reward (None: it failed)
    latest_evaluator: str | None = None
    group_event_id: str | None = None
    group_id: str | None = None
    group_evaluator: str | None = None
    group_reward: float | None = None
    advantage: float | None = None

    def reward(self, evaluator: str | None) -> tuple[bool, float | None]:
        """(answered, reward) from ``evaluator`` (None: the group's evaluator, else the latest that scored
        the session). Answered without a reward: the evaluation failed, or the group kept the sample out."""
        name = evaluator or self.group_evaluator or self.latest_evaluator
        if name is not None and name in self.rewards:
            return True, self.rewards[name]
        if self.group_event_id is not None and (evaluator is None or evaluator == self.group_evaluator):
            return True, self.group_reward
        return False, None


class OutcomeIndex:
    """Session outcomes by session id, at most ``max_sessions`` of them (least recently updated evicted)."""

    def __init__(self, max_sessions: int = DEFAULT_OUTCOME_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be positive, got {max_sessions}")
        self.max_sessions = max_sessions
        self.evicted = 0
        self._items: OrderedDict[str, SessionOutcome] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, session_id: str) -> SessionOutcome | None:
        return self._items.get(session_id)

    def _entry(self, session_id: str) -> SessionOutcome:
        outcome = self._items.get(session_id)
        if outcome is None:
            outcome = self._items[session_id] = SessionOutcome()
            while len(self._items) > self.max_sessions:
                self._items.popitem(last=False)
                self.evicted += 1
        else:
            self._items.move_to_end(session_id)
        return outcome

    def add_evaluation(self, evaluation: Evaluation) -> None:
        outcome = self._entry(evaluation.session_id)
        outcome.rewards[evaluation.evaluator] = evaluation.reward if evaluation.status == "ok" else None
        outcome.latest_evaluator = evaluation.evaluator

    def add_group(self, group: Group) -> None:
        for sample in group.samples:
            outcome = self._entry(sample.session_id)
            outcome.group_event_id, outcome.group_id = group.event_id, group.group_id or group.task_id
            outcome.group_evaluator, outcome.group_reward = group.evaluator, sample.reward
            outcome.advantage = sample.advantage


class OutcomeJoin:
    """Tails `evaluations` and `groups` into an :class:`OutcomeIndex` (see the module docstring)."""

    def __init__(self, settings: KafkaSettings, evaluations_topic: str, groups_topic: str, *,
                 lookback_s: float | None = 3600.0, max_sessions: int = DEFAULT_OUTCOME_SESSIONS) -> None:
        self.settings = settings
        self.lookback_s = lookback_s
        self.index = OutcomeIndex(max_sessions)
        self._specs = [topic_spec(settings, evaluations_topic, like=Topic.EVALUATIONS),
                       topic_spec(settings, groups_topic, like=Topic.GROUPS)]
        self._consumer: EventConsumer | None = None
        self._partitions: list[TopicPartition] = []
        self._target: dict[TopicPartition, int] | None = None  # the log's ends when last measured...
        self._target_at = 0.0  # ...at this monotonic time
        self.known_until = -math.inf  # monotonic time up to which everything written has been read

    async def start(self, first_timestamp_ms: int | None) -> None:
        """Assign every partition of both topics and seek to where the tail starts."""
        if self._consumer is not None:
            return
        # Not the records' processor: what is not an evaluation or a group is skipped, not dead-lettered.
        consumer = EventConsumer(self.settings, self._specs, group_id=None, service="feed-outcomes",
                                 dead_letters=False, dedupe_window=0)
        await consumer.start()
        self._consumer = consumer
        partitions = self._partitions = await self._assign(consumer)
        if self.lookback_s is None or first_timestamp_ms is None:
            await consumer.seek_to_beginning(partitions)
        else:
            await seek_to_time(consumer, partitions, max(0, first_timestamp_ms - int(self.lookback_s * 1000)))

    async def _assign(self, consumer: EventConsumer, timeout_s: float = 30.0) -> list[TopicPartition]:
        """Wait until partitions of both topics are assigned (their metadata may come apart)."""
        names = {spec.name for spec in self._specs}
        deadline = time.monotonic() + timeout_s
        while {tp.topic for tp in consumer.assignment()} != names:
            if time.monotonic() > deadline:
                raise LookupError(f"topics {sorted(names)} have no partitions on {self.settings.kafka_bootstrap}")
            await asyncio.sleep(0.05)
        return sorted(consumer.assignment(), key=lambda tp: (tp.topic, tp.partition))

    async def poll(self, timeout_ms: int = 0) -> int:
        """Index what has come in (waiting up to ``timeout_ms``) and move :attr:`known_until` once the tail
        has read up to the ends it last measured; returns how many events were indexed."""
        consumer = self._consumer
        if consumer is None:
            return 0
        if self._target is None:
            self._target_at = time.monotonic()
            self._target = await consumer.end_offsets(self._partitions)
        received = await consumer.getmany(timeout_ms=timeout_ms)
        for r in received:
            if isinstance(r.event, Evaluation):
                self.index.add_evaluation(r.event)
            elif isinstance(r.event, Group):
                self.index.add_group(r.event)
        if await consumer.caught_up(self._target):
            self.known_until, self._target = self._target_at, None
        return len(received)

    def get(self, session_id: str) -> SessionOutcome | None:
        return self.index.get(session_id)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
