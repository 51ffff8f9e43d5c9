"""What the trainer feed reads, turned into entries of training sequences: groups, or trajectories.

The feed (sinks/feed.py) reads one topic in its consumer group and hands each event to its source:

- :class:`GroupSource` (``groups``): a group's trainable samples (advantage set, trajectory named), their
  trajectories found through :class:`~sinks.join.TrajectoryJoin`; ready at once.
- :class:`TrajectorySource` (``trajectories``): one trajectory, its reward and advantage looked up through
  :class:`~sinks.join.OutcomeJoin` (None: ``rewards=False``). Ready when its reward is in, or once it has
  waited ``reward_wait_s``; its sequences are made then, with what is known at that moment.

Both make one :class:`~sinks.batching.TrainingSequence` per trace with a trained token whose branch role
the feed keeps (sinks/roles.py), and count in the feed's :class:`FeedStats` what they pass over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from aiokafka import TopicPartition

from schemas.envelope import Event
from schemas.groups import Group
from schemas.sessions import FailureKind
from schemas.trajectories import Trajectory
from sinks.batching import TrainingSequence
from sinks.join import IndexedTrajectory, OutcomeJoin, TrajectoryJoin

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FeedStats:
    """What the feed has read and passed over (``stale_*``: groups, or trajectories when it reads those)."""

    groups: int = 0
    trajectories: int = 0
    batches: int = 0
    acked_batches: int = 0
    sequences: int = 0
    samples_without_advantage: int = 0
    samples_without_trajectory: int = 0
    missing_trajectories: int = 0
    groups_without_sequences: int = 0
    trajectories_without_sequences: int = 0
    infrastructure_failures_skipped: int = 0
    rewards_joined: int = 0
    rewards_missing: int = 0  # yielded without a reward: none came within reward_wait_s
    advantages_joined: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    over_budget_batches: int = 0
    no_signal_groups_skipped: int = 0
    insufficient_groups_skipped: int = 0  # under the groups worker's minimum share of usable samples
    unknown_failures_skipped: int = 0  # trajectories whose failure could not be attributed
    stale_skipped: int = 0
    stale_downweighted: int = 0
    stale_skipped_by_lag: dict[int, int] = field(default_factory=dict)
    stale_downweighted_by_lag: dict[int, int] = field(default_factory=dict)
    traces_skipped_by_role: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Entry:
    """One record read (a group, or a trajectory), until it is laid into a batch or passed over.

    ``sequences`` are made when the entry is ready (``built``); ``oldest`` is the weight version its
    staleness is measured from (None: unknown, treated as current).
    """

    partition: TopicPartition
    offset: int
    event_id: str
    oldest: int | None
    sequences: list[TrainingSequence] = field(default_factory=list)
    built: bool = True
    trajectory: IndexedTrajectory | None = None
    read_at: float = 0.0  # monotonic
    wait_until: float = 0.0


class Source(Protocol):
    """How the feed turns the events of its topic into entries."""

    unit: str  # "group" or "trajectory", for messages

    async def start(self, first_timestamp_ms: int) -> None: ...
    async def entry(self, partition: TopicPartition, offset: int, event: Event) -> Entry | None: ...
    def ready(self, entry: Entry, now: float) -> bool: ...
    def build(self, entry: Entry) -> None: ...
    async def poll(self) -> None: ...
    async def stop(self) -> None: ...


def trace_sequences(trajectory: IndexedTrajectory, roles: frozenset[str], stats: FeedStats, *,
                    advantage: float | None, reward: float | None, task_id: str, group_id: str,
                    oldest: int | None) -> list[TrainingSequence]:
    """One sequence per trace with a trained token, of a role in ``roles`` (others counted by role)."""
    sequences = []
    for trace in trajectory.traces:
        if not trace.loss_mask.any():
            continue
        if trace.role not in roles:
            skipped = stats.traces_skipped_by_role
            skipped[trace.role] = skipped.get(trace.role, 0) + 1
            continue
        sequences.append(TrainingSequence(
            token_ids=trace.token_ids, loss_mask=trace.loss_mask, logprobs=trace.logprobs,
            advantage=advantage, session_id=trajectory.session_id, task_id=task_id, group_id=group_id,
            trajectory_id=trajectory.trajectory_id, trace_id=trace.trace_id, reward=reward,
            oldest_version=oldest))
    return sequences


class GroupSource:
    """Groups joined to their trajectories (see the feed's module docstring for which samples count)."""

    unit = "group"

    def __init__(self, join: TrajectoryJoin, roles: frozenset[str], stats: FeedStats, *,
                 skip_no_signal: bool) -> None:
        self.join, self.roles, self.stats, self.skip_no_signal = join, roles, stats, skip_no_signal

    async def start(self, first_timestamp_ms: int) -> None:
        await self.join.start(first_timestamp_ms)

    async def entry(self, partition: TopicPartition, offset: int, event: Event) -> Entry | None:
        assert isinstance(event, Group)  # the feed's consumer dead-letters anything else on the topic
        self.stats.groups += 1
        if event.insufficient:
            # Too few samples the policy can be judged on (after resubmissions): its baseline is noise.
            self.stats.insufficient_groups_skipped += 1
            return None
        if self.skip_no_signal and event.no_signal:
            self.stats.no_signal_groups_skipped += 1
            return None
        sequences = await self._sequences(event)
        if not sequences:
            self.stats.groups_without_sequences += 1
            return None
        # A group written before groups carried versions: its trajectories' oldest.
        known = [s.oldest_version for s in sequences if s.oldest_version is not None]
        oldest = event.policy_versions.oldest if event.policy_versions is not None else (min(known) if known else None)
        return Entry(partition, offset, event.event_id, oldest, sequences)

    async def _sequences(self, group: Group) -> list[TrainingSequence]:
        trainable = []
        for sample in group.samples:
            if sample.advantage is None:
                self.stats.samples_without_advantage += 1
            elif sample.trajectory_id is None:
                self.stats.samples_without_trajectory += 1
            else:
                trainable.append(sample)
        found = await self.join.resolve(s.trajectory_id for s in trainable if s.trajectory_id)
        group_oldest = group.policy_versions.oldest if group.policy_versions is not None else None
        sequences = []
        for sample in trainable:
            trajectory = found.get(sample.trajectory_id or "")
            if trajectory is None:
                self.stats.missing_trajectories += 1
                logger.warning("group %s: trajectory %s of session %s not found on %s; sample skipped",
                               group.event_id, sample.trajectory_id, sample.session_id, self.join.topic)
                continue
            oldest = trajectory.oldest_version if trajectory.oldest_version is not None else group_oldest
            sequences.extend(trace_sequences(
                trajectory, self.roles, self.stats, advantage=sample.advantage, reward=sample.reward,
                task_id=group.task_id, group_id=group.group_id or group.task_id, oldest=oldest))
        return sequences

    def ready(self, entry: Entry, now: float) -> bool:
        return True

    def build(self, entry: Entry) -> None:
        entry.built = True

    async def poll(self) -> None:
        return None

    async def stop(self) -> None:
        await self.join.stop()


class TrajectorySource:
    """Trajectories, with their session's reward and advantage when known (``outcomes`` None: no rewards)."""

    unit = "trajectory"

    def __init__(self, outcomes: OutcomeJoin | None, roles: frozenset[str], stats: FeedStats, *,
                 reward_wait_s: float, evaluator: str | None) -> None:
        self.outcomes, self.roles, self.stats = outcomes, roles, stats
        self.reward_wait_s, self.evaluator = reward_wait_s, evaluator

    async def start(self, first_timestamp_ms: int) -> None:
        if self.outcomes is not None:
            await self.outcomes.start(first_timestamp_ms)

    async def entry(self, partition: TopicPartition, offset: int, event: Event) -> Entry | None:
        assert isinstance(event, Trajectory)  # the feed's consumer dead-letters anything else on the topic
        self.stats.trajectories += 1
        if event.failure is FailureKind.INFRASTRUCTURE:
            self.stats.infrastructure_failures_skipped += 1  # not the policy's doing: never trained on
            return None
        if event.failure is FailureKind.UNKNOWN:
            self.stats.unknown_failures_skipped += 1  # nobody knows whose: never trained on as the policy's
            return None
        trajectory = IndexedTrajectory.of(event)
        now = time.monotonic()
        wait = self.reward_wait_s if self.outcomes is not None else 0.0
        return Entry(partition, offset, event.event_id, trajectory.oldest_version, built=False,
                     trajectory=trajectory, read_at=now, wait_until=now + wait)

    def ready(self, entry: Entry, now: float) -> bool:
        """No rewards wanted; or the reward is in (or the evaluation failed) and the tail has read all that
        was written before the trajectory was read (so a group already written is joined too); or it has
        waited long enough."""
        if self.outcomes is None or now >= entry.wait_until:
            return True
        assert entry.trajectory is not None
        outcome = self.outcomes.get(entry.trajectory.session_id)
        answered = outcome is not None and outcome.reward(self.evaluator)[0]
        return answered and self.outcomes.known_until >= entry.read_at

    def build(self, entry: Entry) -> None:
        """The ready trajectory's sequences, with the reward and advantage known now."""
        trajectory = entry.trajectory
        assert trajectory is not None
        answered, reward, advantage, group_id = False, None, None, None
        outcome = self.outcomes.get(trajectory.session_id) if self.outcomes is not None else None
        if outcome is not None:
            answered, reward = outcome.reward(self.evaluator)
            advantage, group_id = outcome.advantage, outcome.group_id
        if self.outcomes is not None:
            self.stats.rewards_joined += reward is not None
            self.stats.rewards_missing += not answered
            self.stats.advantages_joined += advantage is not None
        task_id = trajectory.task_id or ""
        entry.sequences = trace_sequences(trajectory, self.roles, self.stats, advantage=advantage, reward=reward,
                                          task_id=task_id, group_id=group_id or task_id,
                                          oldest=trajectory.oldest_version)
        entry.built = True
        if not entry.sequences:
            self.stats.trajectories_without_sequences += 1

    async def poll(self) -> None:
        if self.outcomes is not None:
            await self.outcomes.poll(0)

    async def stop(self) -> None:
        if self.outcomes is not None:
            await self.outcomes.stop()
