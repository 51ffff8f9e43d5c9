"""The online trainer feed: `groups` (joined to their trajectories), or `trajectories`, as training batches.

    with TrainerFeed(ReadConfig(group_id="trainer-1", bootstrap="127.0.0.1:19092"),
                     BatchConfig(token_budget=16384), staleness=StalenessConfig(max_staleness=2),
                     policy_version=0) as feed:
        for batch in feed:
            loss = step(batch)          # batch.input_ids, .loss_mask, .logprobs, .advantages, ...
            feed.ack(batch)             # commits the consumer group's offsets through this batch
            feed.policy_version = push_weights()   # the version the engine serves from now on

What it reads (``topic``):

- ``"groups"`` (the default): a batch is made of whole GRPO groups, each sample's trajectory found on
  `trajectories` (sinks/join.py). A sample with ``advantage`` None (a failed or infrastructure-failed
  session, kept out of training) or without a trajectory is skipped. A group the groups worker marked
  ``insufficient`` (fewer usable samples than its minimum share, after resubmissions) is passed over
  (``stats.insufficient_groups_skipped``). ``skip_no_signal`` passes over groups whose rewards were all
  equal (every advantage 0), as dynamic-sampling trainers do.
- ``"trajectories"``: one sample per trajectory, for algorithms that train on each rollout as it comes.
  With ``rewards=True`` (the default) the session's reward (from `evaluations`) and its group advantage
  (from `groups`) are joined by session id (the reverse join, sinks/join.py): the feed waits for the
  reward at most ``reward_wait_s`` after it read the trajectory, then yields it without; it never waits
  for the advantage (a group comes only once every sample of its task is in), which is attached when the
  group was read by then. With several evaluators per session, ``evaluator`` names whose reward counts
  (default: the group's evaluator, else the latest to score it). ``rewards=False``: yield at once, for
  algorithms that need no reward. An unknown reward or advantage is NaN in ``Batch.sample_rewards`` /
  ``Batch.sample_advantages``, False in ``Batch.has_reward`` / ``Batch.has_advantage``, and 0 in the
  per-token ``advantages`` array (so a loss multiplied by it gets nothing from that sequence). A session
  that failed for the infrastructure's sake, or whose failure is ``unknown`` (schemas/attribution.py), is
  not trained on in either mode. Trajectories waiting for
  their reward do not hold back the ones after them: batches may be laid out of read order, and the
  commits still never pass a record that has not been trained on (sinks/offsets.py). ``max_groups`` then
  bounds the trajectories per batch. A topic under another name is read as groups unless ``reads`` says.

In both modes every trace of a trajectory whose branch role the feed keeps becomes one sequence. Roles:
``ReadConfig.roles`` or ``ROLLWIRE_FEED_ROLES``, main and sub_agent by default (a side call such as title generation
must not carry the task's advantage; see sinks/roles.py); traces left out for their role are counted per
role in ``stats.traces_skipped_by_role``.

Staleness (sinks/staleness.py): the trainer tells the feed which policy version it is at, as
``policy_version=`` (an int, or a callable the feed asks) or by setting ``feed.policy_version`` after each
push. A group (a trajectory, when reading trajectories) whose oldest weight version (``policy_versions``)
is more than ``max_staleness`` versions behind is dropped (``stale="drop"``; it is acknowledged past, so
it is not delivered again) or kept with its advantages multiplied by ``stale_decay ** (lag -
max_staleness)`` (``stale="downweight"``; default decay 0.5). Lag is measured when the group is laid into a
batch. Groups and trajectories without versions, and everything before the trainer gives a version, are
treated as current. ``stats.stale_skipped`` / ``stale_downweighted`` count them, ``stale_skipped_by_lag`` /
``stale_downweighted_by_lag`` by lag; each batch carries per sequence ``policy_lags`` (the trainer's version
minus the oldest version of the sequence's trajectory; None when unknown) and ``sample_weights`` (the
factor already applied to its advantages).

Logprobs, for importance sampling: ``Batch.logprobs[r, t]`` is the log-probability the rollout engine gave
the token it sampled at that position, ``input_ids[r, t]``, given ``input_ids[r, :t]`` (vLLM's logprob of
the chosen token as the proxy recorded it, never recomputed; vLLM reports them as its ``--logprobs-mode``
says: the embedded engine runs with ``processed_logprobs``, the distribution it sampled from after
temperature and top-k/top-p; vLLM's own default, ``raw_logprobs``, is before them — start an external
engine with the flag, or train at temperature 1). They are aligned with
``input_ids`` token for token and are 0 wherever ``loss_mask`` is 0 (context, tool results, a sampled
token without a logprob). A causal LM's logits at ``t - 1`` predict token ``t``, so a trainer computes
``logp_train[r, t] = log_softmax(logits[r, t - 1])[input_ids[r, t]]`` (position 0 is never trained) and,
on ``loss_mask == 1``, truncated importance sampling weights ``min(exp(logp_train - logprobs), C)``.

Delivery: offsets are committed by :meth:`TrainerFeed.ack`, synchronously, and acknowledging a batch
acknowledges every batch yielded before it. A trainer that crashes resumes, in the same consumer group,
exactly after its last acknowledged batch: the groups of unacknowledged batches come again, acknowledged
ones never do. (A rebalance that moves a partition to another trainer mid-batch can repeat that batch's
groups there: that is Kafka's at-least-once.) What the feed passes over (a record that is no group or
trajectory, which goes to the dead-letter topic; a duplicate event id; a stale group; nothing to train on)
is committed past as the feed goes, never past a record still waiting for its batch's acknowledgement.

Torch: the feed itself needs only numpy. With ``tensors="torch"`` (the default) each batch's arrays are
converted with a lazy ``import torch``, so rollwire's services and tests do not install torch; a training
environment installs ``rollwire[train]`` (or already has torch). ``tensors="numpy"`` keeps numpy arrays.

The Kafka clients (an EventConsumer in the trainer's consumer group, with a rebalance listener, and the
joins' tails) run on an event loop in a background thread, so the consumer keeps heartbeating while the
trainer computes (a training step may take minutes; ``max_poll_interval_s`` bounds it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, TypeVar

import numpy as np
from aiokafka import ConsumerRebalanceListener, TopicPartition

from schemas.topics import Topic
from schemas.transport import EventConsumer, TransportError, topic_spec
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
from sinks.errors import FeedError as FeedError
from sinks.join import DEFAULT_OUTCOME_SESSIONS, OutcomeJoin, TrajectoryJoin
from sinks.offsets import OffsetLedger
from sinks.roles import feed_roles_from_env, parse_roles
from sinks.sources import Entry, FeedStats, GroupSource, Source, TrajectorySource
from sinks.staleness import StaleAction, StalenessPolicy, VersionSource, Verdict, current_version, lag_of

__all__ = ["Batch", "BatchConfig", "FeedError", "FeedStats", "JoinConfig", "ReadConfig", "StalenessConfig", "TrainerFeed"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
ARRAY_FIELDS = ("input_ids", "attention_mask", "position_ids", "loss_mask", "logprobs", "advantages",
                "segment_ids")


@dataclass(slots=True)
class Batch:
    """One training batch: arrays (numpy or torch) and, per sequence, where it came from.

    Arrays (``[rows, width]``): ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask``,
    ``logprobs`` (rollout logprobs of the sampled tokens, aligned with ``input_ids``, 0 where the loss mask
    is 0: see the module docstring), ``advantages`` (per token, the sample's advantage times its weight, 0
    where the loss mask is 0 or the advantage is unknown) and ``segment_ids`` (0 = padding, i + 1 = the i-th
    sequence). Lists, one entry per sequence (= per row when padded): ``session_ids``, ``group_ids``,
    ``task_ids`` ("" when unknown), ``trajectory_ids``, ``trace_ids``, ``sample_advantages`` (as in the
    arrays, weight applied; NaN when unknown), ``sample_rewards`` (NaN when unknown), ``has_advantage``,
    ``has_reward``, ``sample_weights`` (the staleness factor applied), ``policy_lags`` (None when unknown)
    and ``spans`` (row and token range). ``group_event_ids`` / ``trajectory_event_ids``: the groups (or, when
    the feed reads trajectories, the trajectories) the batch holds.
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
    """Per (topic, partition): what acknowledging this batch commits, if nothing else is done meanwhile."""
    missing_logprobs: int = 0
    feed_id: int = 0
    sample_rewards: list[float] = field(default_factory=list)
    has_advantage: list[bool] = field(default_factory=list)
    has_reward: list[bool] = field(default_factory=list)
    sample_weights: list[float] = field(default_factory=list)
    policy_lags: list[int | None] = field(default_factory=list)
    trajectory_event_ids: list[str] = field(default_factory=list)

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
class _Cut:
    """The batch being laid out: its entries and their (weighted) sequences."""

    entries: list[Entry] = field(default_factory=list)
    sequences: list[TrainingSequence] = field(default_factory=list)
    first_taken: float | None = None


class _Revocations(ConsumerRebalanceListener):
    def __init__(self, feed: TrainerFeed) -> None:
        self.feed = feed

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self.feed._drop_partitions(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        return None


def _count(counter: dict[int, int], lag: int | None) -> None:
    if lag is not None:
        counter[lag] = counter.get(lag, 0) + 1


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


@dataclass(frozen=True, slots=True)
class ReadConfig:
    """What the feed reads and as whom: the topic, the trainer's consumer group (its committed position),
    the branch roles trained on, and how the consumer reads and commits."""

    group_id: str
    topic: str = Topic.GROUPS.value
    bootstrap: str | None = None
    """Overrides the settings' ``kafka_bootstrap`` when given."""
    roles: Iterable[str] | None = None
    """The branch roles whose traces are trained on (None: ``ROLLWIRE_FEED_ROLES``, else main and sub_agent)."""
    reads: Literal["groups", "trajectories"] | None = None
    """How ``topic`` is read (None: as trajectories when it is the trajectories topic, else as groups)."""
    from_beginning: bool = True
    max_poll_interval_s: float = 1800.0
    dedupe_window: int = 100_000


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """How batches are laid out and when one is yielded: the token budget (padding included), padding or
    packing, the tensors' kind, and the waits."""

    token_budget: int
    pack: bool = False
    row_tokens: int | None = None
    """The packed rows' length (None: the budget)."""
    pad_token_id: int = 0
    pad_to_multiple_of: int = 1
    max_groups: int | None = None
    tensors: Literal["torch", "numpy"] = "torch"
    device: Any = None
    linger_s: float = 1.0
    """A partial batch is yielded once no new group has come for this long."""
    idle_timeout_s: float | None = None
    """Iteration stops after this long without any group (None: never, an online trainer waits)."""
    skip_no_signal: bool = False


@dataclass(frozen=True, slots=True)
class StalenessConfig:
    """What the feed does with a group whose weights are more than ``max_staleness`` versions behind the
    trainer's (sinks/staleness.py)."""

    max_staleness: int | None = None
    stale: StaleAction = "drop"
    stale_decay: float = 0.5


@dataclass(frozen=True, slots=True)
class JoinConfig:
    """The joins behind a batch: groups to their trajectories, or trajectories to their rewards and
    advantages (sinks/join.py)."""

    trajectories_topic: str = Topic.TRAJECTORIES.value
    lookback_s: float | None = 3600.0
    timeout_s: float = 30.0
    index_bytes: int = 2 * 1024 ** 3
    rewards: bool = True
    reward_wait_s: float = 60.0
    evaluator: str | None = None
    evaluations_topic: str = Topic.EVALUATIONS.value
    groups_topic: str = Topic.GROUPS.value
    outcome_sessions: int = DEFAULT_OUTCOME_SESSIONS
    """The reverse join's bound on the sessions it holds."""


class TrainerFeed(Iterator[Batch]):
    """Batches from `groups` (or `trajectories`) for an online trainer; see the module docstring.

    Configured by four frozen objects: :class:`ReadConfig` (what to read, as which consumer group),
    :class:`BatchConfig` (the token budget, padding or packing, tensors, waits), :class:`StalenessConfig`
    and :class:`JoinConfig`. ``token_budget`` bounds the tokens a batch lays out, padding included; a group
    that alone exceeds it comes as a batch of its own (counted in ``stats.over_budget_batches``), never
    truncated. ``policy_version`` is the trainer's version (an int, a callable, or None), also settable
    later as ``feed.policy_version``.
    """

    def __init__(self, read: ReadConfig, batching: BatchConfig, *, staleness: StalenessConfig | None = None,
                 joins: JoinConfig | None = None, settings: KafkaSettings | None = None,
                 policy_version: VersionSource = None) -> None:
        staleness = staleness or StalenessConfig()
        joins = joins or JoinConfig()
        self.read, self.batching, self.joins = read, batching, joins
        group_id, topic, bootstrap, roles, reads = read.group_id, read.topic, read.bootstrap, read.roles, read.reads
        token_budget, row_tokens, tensors = batching.token_budget, batching.row_tokens, batching.tensors
        reward_wait_s = joins.reward_wait_s
        if token_budget < 1:
            raise ValueError(f"token_budget must be a positive number of tokens, got {token_budget}")
        if row_tokens is not None and row_tokens < 1:
            raise ValueError(f"row_tokens must be positive, got {row_tokens}")
        if tensors not in ("torch", "numpy"):
            raise ValueError(f"tensors must be 'torch' or 'numpy', got {tensors!r}")
        if reads not in (None, "groups", "trajectories"):
            raise ValueError(f"reads must be 'groups' or 'trajectories', got {reads!r}")
        if reward_wait_s < 0:
            raise ValueError(f"reward_wait_s must be >= 0, got {reward_wait_s}")
        if tensors == "torch" and importlib.util.find_spec("torch") is None:
            # Fail in the constructor, not at the first batch.
            raise ImportError("TrainerFeed(tensors='torch') needs torch: install rollwire[train], or pass "
                              "tensors='numpy'")
        if not group_id:
            raise ValueError("group_id must name the trainer's consumer group (its committed position)")
        self.roles = parse_roles(roles) if roles is not None else feed_roles_from_env()
        self.staleness = StalenessPolicy(staleness.max_staleness, staleness.stale, staleness.stale_decay)
        self.policy_version = policy_version
        if settings is None:
            settings = KafkaSettings(kafka_bootstrap=bootstrap) if bootstrap else KafkaSettings()
        elif bootstrap:
            settings = settings.model_copy(update={"kafka_bootstrap": bootstrap})
        self.settings = settings
        registry = settings.registry()
        self.topic = self._resolve(registry, topic)
        self.reads: Literal["groups", "trajectories"] = reads or (
            "trajectories" if self.topic == registry.name(Topic.TRAJECTORIES) else "groups")
        self.group_id = group_id
        self.token_budget = token_budget
        self.pack = batching.pack
        self.row_tokens = row_tokens or token_budget
        self.pad_token_id = batching.pad_token_id
        self.pad_to_multiple_of = batching.pad_to_multiple_of
        self.max_groups = batching.max_groups
        self.tensors = tensors
        self.device = batching.device
        self.linger_s = batching.linger_s
        self.idle_timeout_s = batching.idle_timeout_s
        self.skip_no_signal = batching.skip_no_signal
        self.rewards = joins.rewards
        self.reward_wait_s = reward_wait_s
        self.evaluator = joins.evaluator
        self.stats = FeedStats()
        self._source: Source
        if self.reads == "groups":
            join = TrajectoryJoin(settings, self._resolve(registry, joins.trajectories_topic),
                                  lookback_s=joins.lookback_s, timeout_s=joins.timeout_s, index_bytes=joins.index_bytes)
            self._source = GroupSource(join, self.roles, self.stats, skip_no_signal=batching.skip_no_signal)
        else:
            outcomes = OutcomeJoin(settings, self._resolve(registry, joins.evaluations_topic),
                                   self._resolve(registry, joins.groups_topic), lookback_s=joins.lookback_s,
                                   max_sessions=joins.outcome_sessions) if joins.rewards else None
            self._source = TrajectorySource(outcomes, self.roles, self.stats, reward_wait_s=reward_wait_s,
                                            evaluator=joins.evaluator)
        self._buffer: list[Entry] = []
        self._cutting = _Cut()
        self._ledger: OffsetLedger[TopicPartition] = OffsetLedger()
        self._committed: dict[TopicPartition, int] = {}
        self._passed_over = False
        self._dedupe_window = read.dedupe_window
        self._batch_number = 0
        self._acked_number = -1
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"trainer-feed-{group_id}",
                                        daemon=True)
        self._thread.start()
        # Created on the loop thread: aiokafka binds its clients to the running loop.
        self._consumer: EventConsumer | None = None
        self._reading: asyncio.Task[Any] | None = None  # the batch being read, if any (see close)
        try:
            self._call(self._start(read.from_beginning, read.max_poll_interval_s))
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

    # -- the trainer's policy version -------------------------------------------------------------------
    @property
    def policy_version(self) -> VersionSource:
        """The trainer's policy version as given: an int, a callable returning one, or None (not known)."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, value: VersionSource) -> None:
        if value is not None and not callable(value) and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"policy_version must be an int, a callable returning one, or None; got {value!r}")
        self._policy_version = value

    def current_policy_version(self) -> int | None:
        """The trainer's policy version now (asks the callable, if one was given)."""
        return current_version(self._policy_version)

    # -- the loop thread ---------------------------------------------------------------------------------
    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self, from_beginning: bool, max_poll_interval_s: float) -> None:
        # The consumer dead-letters a record that is not what the topic holds (for its consumer group) and
        # drops redelivered events by event id; the feed counts both in its stats and commits past them.
        like = Topic.GROUPS if self.reads == "groups" else Topic.TRAJECTORIES
        consumer = EventConsumer(self.settings, [topic_spec(self.settings, self.topic, like=like)],
                                 group_id=self.group_id, service="trainer-feed", from_beginning=from_beginning,
                                 dedupe_window=self._dedupe_window, listener=_Revocations(self),
                                 max_poll_interval_s=max_poll_interval_s)
        self._consumer = consumer
        await consumer.start()

    async def _read_batch(self) -> Batch | None:
        self._reading = asyncio.current_task()
        try:
            return await self._next_batch()
        finally:
            self._reading = None

    async def _cancel_reading(self) -> None:
        """Cancel a batch still being read for a thread that waits on it (never the clients' own tasks)."""
        task = self._reading
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
        await self._source.stop()

    def close(self) -> None:
        """Leave the consumer group and stop the loop thread; unacknowledged batches come again later. A
        ``next()`` still waiting in another thread is cancelled (it raises FeedError)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._cancel_reading())
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
        try:
            batch = self._call(self._read_batch())
        except concurrent.futures.CancelledError as exc:
            raise FeedError("the feed was closed while a batch was being read") from exc
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
        self._call(self._acknowledge(batch.number))
        self._acked_number = batch.number
        self.stats.acked_batches += 1

    async def _acknowledge(self, number: int) -> None:
        self._ledger.acknowledged(number)
        await self._commit(strict=True)

    async def _commit(self, *, strict: bool) -> None:
        """Commit, per assigned partition, how far the ledger says (where that moved). ``strict``: a refusal
        raises FeedError (an acknowledgement); else it is logged (what was passed over comes again)."""
        assert self._consumer is not None
        assigned = self._consumer.assignment()
        commit = {tp: offset for tp, offset in self._ledger.positions().items()
                  if tp in assigned and offset > self._committed.get(tp, -1)}
        self._passed_over = False
        if not commit:
            return
        try:
            await self._consumer.commit(commit)
        except TransportError as exc:
            if strict:
                raise FeedError(f"commit for consumer group {self.group_id} refused: {exc!r}; the batch's "
                                "groups will be delivered again") from exc
            logger.warning("committing past passed-over records failed (%r); they will be read again", exc)
            return
        self._committed.update(commit)

    def _drop_partitions(self, revoked: set[TopicPartition]) -> None:
        """Forget buffered records of partitions given to another consumer (they will read them)."""
        self._buffer = [e for e in self._buffer if e.partition not in revoked]
        self._ledger.forget(revoked)
        for tp in revoked:
            self._committed.pop(tp, None)

    # -- cutting batches --------------------------------------------------------------------------------
    def _cost(self, sequences: list[TrainingSequence]) -> int:
        lengths = [len(s) for s in sequences]
        if self.pack:
            return packed_cost(lengths, self.row_tokens, self.pad_to_multiple_of)
        return padded_cost(lengths, self.pad_to_multiple_of)

    async def _next_batch(self) -> Batch | None:
        started = time.monotonic()
        cut = self._cutting
        while True:
            batch = self._take(cut)
            if batch is not None:
                return batch
            now = time.monotonic()
            if cut.entries and cut.first_taken is not None and now - cut.first_taken >= self.linger_s:
                return self._cut(cut)
            if self._passed_over:
                await self._commit(strict=False)
            if (not cut.entries and not self._buffer and self.idle_timeout_s is not None
                    and now - started >= self.idle_timeout_s):
                return None
            await self._fill(timeout_ms=200)

    def _take(self, cut: _Cut) -> Batch | None:
        """Lay ready entries into the batch being cut, in read order; returns the batch once it is full."""
        now = time.monotonic()
        current = self.current_policy_version()
        index = 0
        while index < len(self._buffer):
            entry = self._buffer[index]
            if not entry.built:
                if not self._source.ready(entry, now):
                    index += 1  # a trajectory waiting for its reward: the ones after it may go first
                    continue
                self._source.build(entry)
            verdict = self.staleness.judge(entry.oldest, current)
            if not entry.sequences or verdict.drop:
                del self._buffer[index]
                self._pass_over(entry, verdict)
                continue
            sequences = [replace(s, weight=verdict.weight, policy_lag=lag_of(s.oldest_version, current))
                         for s in entry.sequences]
            cost = self._cost(cut.sequences + sequences)
            if cut.entries and cost > self.token_budget:
                return self._cut(cut)
            del self._buffer[index]
            if verdict.stale:
                self.stats.stale_downweighted += 1
                _count(self.stats.stale_downweighted_by_lag, verdict.lag)
            cut.entries.append(entry)
            cut.sequences.extend(sequences)
            cut.first_taken = cut.first_taken or time.monotonic()
            if cost >= self.token_budget or (self.max_groups and len(cut.entries) >= self.max_groups):
                return self._cut(cut)
        return None

    def _pass_over(self, entry: Entry, verdict: Verdict) -> None:
        """An entry with nothing to train on, or too stale: done, committed past as the feed goes."""
        if entry.sequences and verdict.drop:
            self.stats.stale_skipped += 1
            _count(self.stats.stale_skipped_by_lag, verdict.lag)
            logger.info("%s %s is %s versions behind the trainer's %s: dropped", self._source.unit, entry.event_id,
                        verdict.lag, self.current_policy_version())
        self._ledger.done(entry.partition, entry.offset)
        self._passed_over = True

    def _cut(self, cut: _Cut) -> Batch:
        if self.pack:
            arrays: BatchArrays = pack_sequences(cut.sequences, self.row_tokens, self.pad_token_id,
                                                 self.pad_to_multiple_of)
        else:
            arrays = pad_sequences(cut.sequences, self.pad_token_id, self.pad_to_multiple_of)
        number = self._batch_number
        for entry in cut.entries:
            self._ledger.batched(entry.partition, entry.offset, number)
        sequences = cut.sequences
        event_ids = [e.event_id for e in cut.entries]
        batch = Batch(
            number=number, packed=self.pack,
            **{name: getattr(arrays, name) for name in ARRAY_FIELDS},
            session_ids=[s.session_id for s in sequences], group_ids=[s.group_id for s in sequences],
            task_ids=[s.task_id for s in sequences], trajectory_ids=[s.trajectory_id for s in sequences],
            trace_ids=[s.trace_id for s in sequences],
            sample_advantages=[_nan(s.weighted_advantage) for s in sequences],
            spans=arrays.spans,
            group_event_ids=event_ids if self.reads == "groups" else [],
            offsets={(tp.topic, tp.partition): o for tp, o in self._ledger.positions(through=number).items()},
            missing_logprobs=arrays.missing_logprobs, feed_id=id(self),
            sample_rewards=[_nan(s.reward) for s in sequences],
            has_advantage=[s.advantage is not None for s in sequences],
            has_reward=[s.reward is not None for s in sequences],
            sample_weights=[s.weight for s in sequences], policy_lags=[s.policy_lag for s in sequences],
            trajectory_event_ids=event_ids if self.reads == "trajectories" else [],
        )
        self._cutting = _Cut()
        self._batch_number += 1
        self.stats.batches += 1
        self.stats.sequences += len(sequences)
        if batch.tokens > self.token_budget:
            self.stats.over_budget_batches += 1
            logger.warning("batch %d lays out %d tokens, over the budget of %d: one %s that large comes "
                           "alone", batch.number, batch.tokens, self.token_budget, self._source.unit)
        return batch

    # -- reading ----------------------------------------------------------------------------------------
    async def _fill(self, timeout_ms: int) -> None:
        """Read what has come (waiting up to ``timeout_ms``) into the buffer; every record read is in the
        ledger, those that are no event of the topic (dead-lettered) or duplicates done at once."""
        assert self._consumer is not None
        try:
            records = await self._consumer.getmany_raw(timeout_ms=timeout_ms)
            if records:
                await self._source.start(min(r.timestamp_ms for r in records))
            for record in records:
                tp = TopicPartition(record.topic, record.partition)
                self._ledger.read(tp, record.offset)
                received = await self._consumer.take(record)
                entry = await self._source.entry(tp, record.offset, received.event) if received else None
                if entry is None:
                    self._ledger.done(tp, record.offset)
                    self._passed_over = True
                else:
                    self._buffer.append(entry)
            await self._source.poll()
        except TransportError as exc:
            raise FeedError(f"reading {self.topic} failed: {exc}") from exc
        self.stats.duplicates = self._consumer.duplicates_skipped
        self.stats.dead_lettered = self._consumer.dead_lettered
