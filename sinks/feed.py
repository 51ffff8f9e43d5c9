"""The online trainer feed: `groups` (joined to their trajectories) as batches a trainer iterates over.

    with TrainerFeed("127.0.0.1:19092", group_id="trainer-1", token_budget=16384) as feed:
        for batch in feed:
            loss = step(batch)          # batch.input_ids, .loss_mask, .logprobs, .advantages, ...
            feed.ack(batch)             # commits the consumer group's offsets through this batch

Delivery: a batch is made of whole groups, in the order of each partition. Offsets are committed only by
:meth:`TrainerFeed.ack`, synchronously, and acknowledging a batch acknowledges every batch yielded before
it (offsets are cumulative). A trainer that crashes resumes, in the same consumer group, exactly after its
last acknowledged batch: the groups of unacknowledged batches come again, acknowledged ones never do. (A
rebalance that moves a partition to another trainer mid-batch can repeat that batch's groups there: that
is Kafka's at-least-once.) Group events are deduplicated by event id; a record that is not a group goes
to the dead-letter topic and is passed over.

Samples: a sample with ``advantage`` None (a failed or infrastructure-failed session, kept out of training)
or without a trajectory is skipped; every trace of a trajectory whose branch role the feed keeps becomes one
sequence carrying the sample's advantage (see sinks/join.py for how trajectories are found and
sinks/batching.py for the arrays). Roles: ``roles=`` or ``ROLLWIRE_FEED_ROLES``, main and sub_agent by
default (a side call such as title generation must not carry the task's advantage; see sinks/roles.py);
traces left out for their role are counted per role in ``stats.traces_skipped_by_role``.

Torch: the feed itself needs only numpy. With ``tensors="torch"`` (the default) each batch's arrays are
converted with a lazy ``import torch``, so rollwire's services and tests do not install torch; a training
environment installs ``rollwire[train]`` (or already has torch). ``tensors="numpy"`` keeps numpy arrays.

The Kafka clients (an EventConsumer in the trainer's consumer group, with a rebalance listener) run on an
event loop in a background thread, so the consumer keeps heartbeating while the trainer computes (a
training step may take minutes; ``max_poll_interval_s`` bounds it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
from collections import deque
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, TypeVar

import numpy as np
from aiokafka import ConsumerRebalanceListener, TopicPartition

from schemas.groups import Group
from schemas.topics import Topic
from schemas.transport import EventConsumer, Received, TransportError, topic_spec
from schemas.transport.settings import KafkaSettings
from sinks.batching import (
    BatchArrays,
    SequenceSpan,
    TrainingSequence,
    pack_sequences,
    packed_cost,
    pad_sequences,
    padded_cost,
)
from sinks.join import TrajectoryJoin
from sinks.roles import feed_roles_from_env, parse_roles

logger = logging.getLogger(__name__)

T = TypeVar("T")
ARRAY_FIELDS = ("input_ids", "attention_mask", "position_ids", "loss_mask", "logprobs", "advantages",
                "segment_ids")


class FeedError(Exception):
    """The trainer feed cannot go on (Kafka unreachable, a commit refused)."""


@dataclass(slots=True)
class Batch:
    """One training batch: arrays (numpy or torch) and, per sequence, where it came from.

    Arrays (``[rows, width]``): ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask``,
    ``logprobs`` (rollout logprobs, 0 where the loss mask is 0), ``advantages`` (per token, 0 where the
    loss mask is 0) and ``segment_ids`` (0 = padding, i + 1 = the i-th sequence). Lists, one entry per
    sequence (= per row when padded): ``session_ids``, ``group_ids``, ``task_ids``, ``trajectory_ids``,
    ``trace_ids``, ``sample_advantages`` and ``spans`` (row and token range).
    """

    number: int
    packed: bool
    input_ids: Any
    attention_mask: Any
    position_ids: Any
    loss_mask: Any
    logprobs: Any
    advantages: Any
    segment_ids: Any
    session_ids: list[str]
    group_ids: list[str]
    task_ids: list[str]
    trajectory_ids: list[str]
    trace_ids: list[str]
    sample_advantages: list[float]
    spans: list[SequenceSpan]
    group_event_ids: list[str]
    offsets: dict[tuple[str, int], int] = field(repr=False)
    """Per (topic, partition): the next offset to read once this batch is acknowledged (cumulative)."""
    missing_logprobs: int = 0
    feed_id: int = 0

    @property
    def tokens(self) -> int:
        """Tokens laid out, padding included (what the token budget bounds)."""
        rows, width = self.input_ids.shape
        return int(rows) * int(width)

    def to_torch(self, device: Any = None) -> Batch:
        """The same batch with torch tensors (imports torch here, not at module import)."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("the trainer feed's torch tensors need torch: install rollwire[train], or "
                              "pass tensors='numpy' to TrainerFeed") from exc
        converted = {}
        for name in ARRAY_FIELDS:
            value = getattr(self, name)
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(np.ascontiguousarray(value))
            converted[name] = value.to(device) if device is not None else value
        return replace(self, **converted)


@dataclass(slots=True)
class FeedStats:
    """What the feed has read and passed over."""

    groups: int = 0
    batches: int = 0
    acked_batches: int = 0
    sequences: int = 0
    samples_without_advantage: int = 0
    samples_without_trajectory: int = 0
    missing_trajectories: int = 0
    groups_without_sequences: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    over_budget_batches: int = 0
    no_signal_groups_skipped: int = 0
    traces_skipped_by_role: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Entry:
    """One record read from the groups topic, in partition order; ``sequences`` empty = passed over."""

    partition: TopicPartition
    offset: int
    group: Group | None
    sequences: list[TrainingSequence]


class _Revocations(ConsumerRebalanceListener):
    def __init__(self, feed: TrainerFeed) -> None:
        self.feed = feed

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self.feed._drop_partitions(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        return None


class TrainerFeed(Iterator[Batch]):
    """Batches of whole GRPO groups from `groups`, joined to their trajectories; see the module docstring.

    ``token_budget`` bounds the tokens a batch lays out, padding included; a group that alone exceeds it
    comes as a batch of its own (counted in ``stats.over_budget_batches``), never truncated. With
    ``pack=True`` sequences are packed into rows of ``row_tokens`` (default: the budget). A partial batch is
    yielded once no new group has come for ``linger_s``; iteration stops after ``idle_timeout_s`` without
    any group (None: never, an online trainer waits). ``skip_no_signal`` passes over groups whose rewards
    were all equal (every advantage 0), as dynamic-sampling trainers do. ``roles`` are the branch roles whose
    traces are trained on (None: ``ROLLWIRE_FEED_ROLES``, else main and sub_agent).
    """

    def __init__(self, bootstrap: str | None = None, topic: str = Topic.GROUPS.value, *,
                 group_id: str, token_budget: int, pack: bool = False, row_tokens: int | None = None,
                 pad_token_id: int = 0, pad_to_multiple_of: int = 1, max_groups: int | None = None,
                 tensors: Literal["torch", "numpy"] = "torch", device: Any = None,
                 trajectories_topic: str = Topic.TRAJECTORIES.value, settings: KafkaSettings | None = None,
                 from_beginning: bool = True, linger_s: float = 1.0, idle_timeout_s: float | None = None,
                 join_lookback_s: float | None = 3600.0, join_timeout_s: float = 30.0,
                 join_index_bytes: int = 2 * 1024 ** 3, max_poll_interval_s: float = 1800.0,
                 dedupe_window: int = 100_000, skip_no_signal: bool = False,
                 roles: Iterable[str] | None = None) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be a positive number of tokens, got {token_budget}")
        if row_tokens is not None and row_tokens < 1:
            raise ValueError(f"row_tokens must be positive, got {row_tokens}")
        if tensors not in ("torch", "numpy"):
            raise ValueError(f"tensors must be 'torch' or 'numpy', got {tensors!r}")
        if tensors == "torch" and importlib.util.find_spec("torch") is None:
            # Fail in the constructor, not at the first batch.
            raise ImportError("TrainerFeed(tensors='torch') needs torch: install rollwire[train], or pass "
                              "tensors='numpy'")
        if not group_id:
            raise ValueError("group_id must name the trainer's consumer group (its committed position)")
        self.roles = parse_roles(roles) if roles is not None else feed_roles_from_env()
        if settings is None:
            settings = KafkaSettings(kafka_bootstrap=bootstrap) if bootstrap else KafkaSettings()
        elif bootstrap:
            settings = settings.model_copy(update={"kafka_bootstrap": bootstrap})
        self.settings = settings
        registry = settings.registry()
        self.topic = self._resolve(registry, topic)
        self.group_id = group_id
        self.token_budget = token_budget
        self.pack = pack
        self.row_tokens = row_tokens or token_budget
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_groups = max_groups
        self.tensors = tensors
        self.device = device
        self.linger_s = linger_s
        self.idle_timeout_s = idle_timeout_s
        self.skip_no_signal = skip_no_signal
        self.stats = FeedStats()
        self._join = TrajectoryJoin(settings, self._resolve(registry, trajectories_topic),
                                    lookback_s=join_lookback_s, timeout_s=join_timeout_s,
                                    index_bytes=join_index_bytes)
        self._buffer: deque[_Entry] = deque()
        self._positions: dict[TopicPartition, int] = {}
        self._dedupe_window = dedupe_window
        self._batch_number = 0
        self._acked_number = -1
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"trainer-feed-{group_id}",
                                        daemon=True)
        self._thread.start()
        # Created on the loop thread: aiokafka binds its clients to the running loop.
        self._consumer: EventConsumer | None = None
        try:
            self._call(self._start(from_beginning, max_poll_interval_s))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _resolve(registry: Any, topic: str) -> str:
        """A logical topic name (``groups``) gets the deployment's prefix; any other name is used as is."""
        try:
            return registry.name(Topic(topic))
        except ValueError:
            return topic

    # -- the loop thread ---------------------------------------------------------------------------------
    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self, from_beginning: bool, max_poll_interval_s: float) -> None:
        # The consumer dead-letters a record that is not a group (for its consumer group) and drops
        # redelivered group events by event id; the feed counts both in its stats.
        consumer = EventConsumer(self.settings, [topic_spec(self.settings, self.topic, like=Topic.GROUPS)],
                                 group_id=self.group_id, service="trainer-feed", from_beginning=from_beginning,
                                 dedupe_window=self._dedupe_window, listener=_Revocations(self),
                                 max_poll_interval_s=max_poll_interval_s)
        self._consumer = consumer
        await consumer.start()

    async def _stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
        await self._join.stop()

    def close(self) -> None:
        """Leave the consumer group and stop the loop thread; unacknowledged batches come again later."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    def __enter__(self) -> TrainerFeed:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- iteration and acknowledgement ------------------------------------------------------------------
    def __iter__(self) -> TrainerFeed:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        batch = self._call(self._next_batch())
        if batch is None:
            raise StopIteration
        return batch.to_torch(self.device) if self.tensors == "torch" else batch

    def ack(self, batch: Batch) -> None:
        """Commit the group's offsets through this batch (and every batch before it); returns once the
        broker has them. Acknowledging an older batch than one already acknowledged does nothing."""
        if batch.feed_id != id(self):
            raise ValueError("this batch did not come from this feed")
        if batch.number <= self._acked_number:
            return
        self._call(self._commit(batch.offsets))
        self._acked_number = batch.number
        self.stats.acked_batches += 1

    async def _commit(self, offsets: dict[tuple[str, int], int]) -> None:
        assert self._consumer is not None
        assigned = self._consumer.assignment()
        commit = {TopicPartition(t, p): o for (t, p), o in offsets.items() if TopicPartition(t, p) in assigned}
        if not commit:
            return
        try:
            await self._consumer.commit(commit)
        except TransportError as exc:
            raise FeedError(f"commit for consumer group {self.group_id} refused: {exc!r}; the batch's "
                            "groups will be delivered again") from exc

    def _drop_partitions(self, revoked: set[TopicPartition]) -> None:
        """Forget buffered records of partitions given to another consumer (they will read them)."""
        self._buffer = deque(e for e in self._buffer if e.partition not in revoked)
        for tp in revoked:
            self._positions.pop(tp, None)

    # -- cutting batches --------------------------------------------------------------------------------
    def _cost(self, sequences: list[TrainingSequence]) -> int:
        lengths = [len(s) for s in sequences]
        if self.pack:
            return packed_cost(lengths, self.row_tokens, self.pad_to_multiple_of)
        return padded_cost(lengths, self.pad_to_multiple_of)

    async def _next_batch(self) -> Batch | None:
        started = time.monotonic()
        first_taken: float | None = None
        taken: list[_Entry] = []
        sequences: list[TrainingSequence] = []
        while True:
            while self._buffer:
                entry = self._buffer[0]
                if not entry.sequences:
                    self._buffer.popleft()
                    self._positions[entry.partition] = entry.offset + 1
                    continue
                cost = self._cost(sequences + entry.sequences)
                if taken and cost > self.token_budget:
                    return self._cut(taken, sequences)
                self._buffer.popleft()
                self._positions[entry.partition] = entry.offset + 1
                taken.append(entry)
                sequences.extend(entry.sequences)
                first_taken = first_taken or time.monotonic()
                if cost >= self.token_budget or (self.max_groups and len(taken) >= self.max_groups):
                    return self._cut(taken, sequences)
            now = time.monotonic()
            if taken and first_taken is not None and now - first_taken >= self.linger_s:
                return self._cut(taken, sequences)
            if not taken and self.idle_timeout_s is not None and now - started >= self.idle_timeout_s:
                return None
            await self._fill(timeout_ms=200)

    def _cut(self, taken: list[_Entry], sequences: list[TrainingSequence]) -> Batch:
        if self.pack:
            arrays: BatchArrays = pack_sequences(sequences, self.row_tokens, self.pad_token_id,
                                                 self.pad_to_multiple_of)
        else:
            arrays = pad_sequences(sequences, self.pad_token_id, self.pad_to_multiple_of)
        batch = Batch(
            number=self._batch_number, packed=self.pack,
            **{name: getattr(arrays, name) for name in ARRAY_FIELDS},
            session_ids=[s.session_id for s in sequences], group_ids=[s.group_id for s in sequences],
            task_ids=[s.task_id for s in sequences], trajectory_ids=[s.trajectory_id for s in sequences],
            trace_ids=[s.trace_id for s in sequences], sample_advantages=[s.advantage for s in sequences],
            spans=arrays.spans,
            group_event_ids=[e.group.event_id for e in taken if e.group is not None],
            offsets={(tp.topic, tp.partition): offset for tp, offset in self._positions.items()},
            missing_logprobs=arrays.missing_logprobs, feed_id=id(self),
        )
        self._batch_number += 1
        self.stats.batches += 1
        self.stats.sequences += len(sequences)
        if batch.tokens > self.token_budget:
            self.stats.over_budget_batches += 1
            logger.warning("batch %d lays out %d tokens, over the budget of %d: one group that large comes "
                           "alone", batch.number, batch.tokens, self.token_budget)
        return batch

    # -- reading groups ---------------------------------------------------------------------------------
    async def _fill(self, timeout_ms: int) -> None:
        assert self._consumer is not None
        try:
            received = await self._consumer.getmany(timeout_ms=timeout_ms)
        except TransportError as exc:
            raise FeedError(f"reading {self.topic} failed: {exc}") from exc
        self.stats.duplicates = self._consumer.duplicates_skipped
        self.stats.dead_lettered = self._consumer.dead_lettered
        if not received:
            return
        await self._join.start(min(r.timestamp_ms for r in received))
        for r in received:
            self._buffer.append(await self._entry(r))

    async def _entry(self, received: Received) -> _Entry:
        tp = TopicPartition(received.topic, received.partition)
        event = received.event
        assert isinstance(event, Group)  # the consumer dead-letters anything else on the groups topic
        self.stats.groups += 1
        if self.skip_no_signal and getattr(event, "no_signal", False):
            self.stats.no_signal_groups_skipped += 1
            return _Entry(tp, received.offset, None, [])
        sequences = await self._sequences(event)
        if not sequences:
            self.stats.groups_without_sequences += 1
        return _Entry(tp, received.offset, event, sequences)

    async def _sequences(self, group: Group) -> list[TrainingSequence]:
        trainable = []
        for sample in group.samples:
            if sample.advantage is None:
                self.stats.samples_without_advantage += 1
            elif sample.trajectory_id is None:
                self.stats.samples_without_trajectory += 1
            else:
                trainable.append(sample)
        found = await self._join.resolve(s.trajectory_id for s in trainable if s.trajectory_id)
        sequences = []
        for sample in trainable:
            trajectory = found.get(sample.trajectory_id or "")
            if trajectory is None:
                self.stats.missing_trajectories += 1
                logger.warning("group %s: trajectory %s of session %s not found on %s; sample skipped",
                               group.event_id, sample.trajectory_id, sample.session_id, self._join.topic)
                continue
            for trace in trajectory.traces:
                if not trace.loss_mask.any():
                    continue
                if trace.role not in self.roles:
                    skipped = self.stats.traces_skipped_by_role
                    skipped[trace.role] = skipped.get(trace.role, 0) + 1
                    continue
                sequences.append(TrainingSequence(
                    token_ids=trace.token_ids, loss_mask=trace.loss_mask, logprobs=trace.logprobs,
                    advantage=float(sample.advantage or 0.0), session_id=sample.session_id,
                    task_id=group.task_id, group_id=group.group_id or group.task_id,
                    trajectory_id=trajectory.trajectory_id, trace_id=trace.trace_id))
        return sequences
