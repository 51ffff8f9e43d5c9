"""Which offsets of the ``sessions`` partitions a gateway node may commit.

A node receives many session specs and finishes them out of order; the group's committed offset of a
partition may only move past a spec once its session has ended here (or was skipped, or found ended).
So per assigned partition this keeps the offsets received and not finished; the committable position is
the lowest of them, or one past the highest received when none is open. A spec this node lets go (a
queued session at drain) stays open, so the next owner of the partition gets it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka import TopicPartition


@dataclass(slots=True)
class _Partition:
    open: set[int] = field(default_factory=set)
    next: int | None = None
    committed: int | None = None

    def position(self) -> int | None:
        if self.open:
            return min(self.open)
        return self.next


class OffsetBook:
    """Open offsets per assigned partition and what to commit."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _Partition] = {}

    def assign(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self._partitions.setdefault(tp, _Partition())

    def revoke(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self._partitions.pop(tp, None)

    def __len__(self) -> int:
        return len(self._partitions)

    def owns(self, tp: TopicPartition) -> bool:
        return tp in self._partitions

    def received(self, tp: TopicPartition, offset: int) -> None:
        partition = self._partitions.setdefault(tp, _Partition())
        partition.open.add(offset)
        partition.next = max(partition.next or 0, offset + 1)

    def read_up_to(self, tp: TopicPartition, position: int) -> None:
        """Everything before ``position`` was received (records the consumer dead-lettered included)."""
        partition = self._partitions.get(tp)
        if partition is not None:
            partition.next = max(partition.next or 0, position)

    def finish(self, tp: TopicPartition, offset: int) -> None:
        """The record at ``offset`` is done with; a no-op for a partition no longer assigned here."""
        partition = self._partitions.get(tp)
        if partition is not None:
            partition.open.discard(offset)

    def to_commit(self, partitions: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Positions that moved since they were last committed (of ``partitions``, default all)."""
        out: dict[TopicPartition, int] = {}
        for tp, partition in self._partitions.items():
            if partitions is not None and tp not in partitions:
                continue
            position = partition.position()
            if position is not None and position != partition.committed:
                out[tp] = position
        return out

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, position in offsets.items():
            if tp in self._partitions:
                self._partitions[tp].committed = position
