"""How far the trainer feed may commit: per partition, the records read and not yet done.

A record the feed reads is *open* until it is done: passed over (not a group, a duplicate, stale, nothing
to train on) or in a batch the trainer acknowledged. A record laid into a batch stays open, marked with the
batch's number, until that batch (or a later one: acknowledgements are cumulative) is acknowledged. The
consumer group may commit, per partition, up to the first open record, or up to the end of what was read
when none is open: committing there never skips a record that still has to be trained on, however the
records were batched (the trajectories feed lays records into batches out of order: one waiting for its
reward does not hold back the next).

Pure bookkeeping, no Kafka: the feed (sinks/feed.py) feeds it and commits what :meth:`OffsetLedger.positions`
says.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)  # a partition (aiokafka's TopicPartition in the feed)

UNBATCHED = -1


class OffsetLedger(Generic[P]):
    """Open records per partition (offset -> the number of the batch holding it, or UNBATCHED)."""

    def __init__(self) -> None:
        self._open: dict[P, dict[int, int]] = {}
        self._read: dict[P, int] = {}

    def read(self, partition: P, offset: int) -> None:
        """A record was read: open until :meth:`done` or its batch is acknowledged."""
        self._open.setdefault(partition, {})[offset] = UNBATCHED
        self.passed(partition, offset)

    def passed(self, partition: P, offset: int) -> None:
        """Everything up to ``offset`` of ``partition`` was read (records the feed never sees count as done)."""
        self._read[partition] = max(self._read.get(partition, 0), offset + 1)

    def done(self, partition: P, offset: int) -> None:
        """A record was passed over: nothing in it waits for an acknowledgement."""
        self._open.get(partition, {}).pop(offset, None)

    def batched(self, partition: P, offset: int, number: int) -> None:
        """A record was laid into batch ``number``: open until that batch is acknowledged."""
        records = self._open.get(partition)
        if records is not None and offset in records:
            records[offset] = number

    def acknowledged(self, number: int) -> None:
        """Batch ``number`` and every batch before it are acknowledged: their records are done."""
        for records in self._open.values():
            for offset in [o for o, batch in records.items() if UNBATCHED < batch <= number]:
                del records[offset]

    def positions(self, *, through: int | None = None) -> dict[P, int]:
        """Per partition, the offset the group may commit: its first open record, else the end of what was
        read. ``through``: as if batches up to that number were acknowledged too."""
        out: dict[P, int] = {}
        for partition, end in self._read.items():
            records = self._open.get(partition, {})
            still = [o for o, batch in records.items() if through is None or not UNBATCHED < batch <= through]
            out[partition] = min(still) if still else end
        return out

    def open_count(self) -> int:
        """Records read and not done yet."""
        return sum(len(records) for records in self._open.values())

    def forget(self, partitions: Iterable[P]) -> None:
        """Partitions given to another consumer: what was read of them is theirs to read again."""
        for partition in partitions:
            self._open.pop(partition, None)
            self._read.pop(partition, None)
