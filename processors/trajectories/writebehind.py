"""Write-behind for the worker's tables: writes are held in memory and applied in one pass per flush.

A Faust table write is a RocksDB put plus a changelog record; made once per input record it was the
largest cost of the trajectory worker. :class:`BufferedTable` keeps a table's pending writes (value or
deletion, with the partition they belong to) and answers reads from them first, so the aggregator sees
its own writes at once; :func:`flush` applies every table's pending writes partition by partition.

The app acknowledges an input record only after the flush that covers it, so a record whose effect is
still only in memory has not been committed: after a crash or a rebalance it is read again and its effect
is redone. A session touched by many records between two flushes costs one write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping

Table = MutableMapping[bytes, bytes]


class BufferedTable:
    """A table plus its pending writes (key -> (partition, value, or None for a deletion))."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.pending: dict[bytes, tuple[int, bytes | None]] = {}

    def get(self, key: bytes) -> bytes | None:
        hit = self.pending.get(key)
        if hit is not None:
            return hit[1]
        return self.table.get(key)

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    def put(self, key: bytes, value: bytes, partition: int) -> None:
        self.pending[key] = (partition, value)

    def delete(self, key: bytes, partition: int) -> None:
        self.pending[key] = (partition, None)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """The table's entries with the pending writes applied (for the timer's one full scan)."""
        for key, value in self.table.items():
            if key not in self.pending:
                yield key, value
        for key, (_, pending) in self.pending.items():
            if pending is not None:
                yield key, pending

    def _apply(self, key: bytes, value: bytes | None) -> None:
        if value is not None:
            self.table[key] = value
            return
        try:
            del self.table[key]
        except KeyError:  # a dict in tests; the RocksDB store deletes a missing key silently
            pass


def flush(tables: Iterable[BufferedTable], enter_partition: Callable[[int], bool],
          keep: Callable[[int], bool] | None = None) -> int:
    """Apply the pending writes of ``tables``, grouped by partition; return how many were applied.

    ``enter_partition(p)`` prepares writes to partition ``p`` (the Faust app makes one of that partition's
    records the current event, which is where a table write finds its store and changelog partition) and
    returns False if it cannot: then the writes stay pending when ``keep(p)`` (the partition is still
    ours: they were staged by a record still being handled, which the next flush covers) and are dropped
    otherwise (``p`` is not ours any more: their records were not acknowledged, so the partition's new
    owner redoes them). Dropping a write of a partition still ours would lose it for good: its record is
    acknowledged at the next flush, and only the in-memory copy (processors.trajectories.aggregate) still had it.
    """
    by_partition: dict[int, list[tuple[BufferedTable, bytes, bytes | None]]] = {}
    for table in tables:
        for key, (partition, value) in table.pending.items():
            by_partition.setdefault(partition, []).append((table, key, value))
        table.pending = {}
    applied = 0
    for partition, writes in by_partition.items():
        if not enter_partition(partition):
            if keep is not None and keep(partition):
                for table, key, value in writes:
                    table.pending.setdefault(key, (partition, value))
            continue
        for table, key, value in writes:
            table._apply(key, value)
        applied += len(writes)
    return applied


def discard(tables: Iterable[BufferedTable]) -> None:
    """Forget every pending write (partitions were revoked: their records will be read again)."""
    for table in tables:
        table.pending = {}
