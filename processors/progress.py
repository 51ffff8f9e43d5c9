"""How far the worker has read each input partition: is everything up to time T in?

A session's completions, spec and end event sit on three topics; Faust reads their partitions
independently, so the end event can be read before the session's last completions (a replay after a
restart reads the small session events far ahead of the large completions). Before a session is built,
its partition of each other input must be read up to the end event's record timestamp: either a record
with a later timestamp has been processed there (its watermark passed), or the partition is drained (our last processed
offset reaches the partition's end). This is derived from the stream, kept in memory, and reset at
every rebalance.

"Drained" needs an end offset the broker gave *after* the end record was handled. The consumer's own
high watermark is only as fresh as its last fetch of that partition, and a partition that is paused or
still has fetched records buffered is not fetched: a session's last call, acknowledged before its end was
sent, can lie past a stale high watermark (seen in bench.pipeline: 70 of 3,000 sessions built without a
call). The worker asks the broker for the ends on its timer (:meth:`InputProgress.asked_ends`) and
:meth:`InputProgress.log_end` gives an end only if it was asked since a given time.

A transactional producer's commit (or abort) marker takes an offset no consumer ever sees, so a partition
whose last record came from a transaction stays one or a few offsets short of its end. The worker's
catch-up reads such an end back from the log (processors.continuity) and reports the offsets it found no
record at (:meth:`InputProgress.accounted`): only then is the partition drained. A quiet spell was
trusted before, but a record the stream holds back (a paused partition) is quiet too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping


class InputProgress:
    """Per (topic, partition): the last offset processed and the latest record timestamp seen."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._offsets: dict[tuple[str, int], int] = {}
        self._watermarks: dict[tuple[str, int], float] = {}
        self.active_since: float | None = None
        # End offsets asked from the broker, with the worker-clock time each was asked.
        self._log_ends: dict[tuple[str, int], tuple[int, float]] = {}

    def reset(self) -> None:
        """Forget everything (partitions were revoked or assigned)."""
        self._log_ends.clear()
        self._offsets.clear()
        self._watermarks.clear()
        self.active_since = None

    def saw(self, topic: str, partition: int, offset: int, timestamp: float) -> None:
        tp = (topic, partition)
        self._offsets[tp] = offset
        if timestamp > self._watermarks.get(tp, 0.0):
            self._watermarks[tp] = timestamp

    def accounted(self, topic: str, partition: int, offset: int) -> None:
        """Offsets up to ``offset`` were read back from the log: those with no record are markers."""
        tp = (topic, partition)
        self._offsets[tp] = max(self._offsets.get(tp, -1), offset)

    def asked_ends(self, ends: Mapping[tuple[str, int], int], asked_at: float) -> None:
        """The broker gave these end offsets to a request sent at ``asked_at`` (worker clock)."""
        for tp, end in ends.items():
            self._log_ends[tp] = (end, asked_at)

    def log_end(self, topic: str, partition: int, since: float) -> int | None:
        """The partition's end offset as the broker gave it to a request sent at or after ``since``; None
        if none was asked since (an end from before a record was handled may not include it)."""
        known = self._log_ends.get((topic, partition))
        if known is None or known[1] < since:
            return None
        return known[0]

    def processed(self, topic: str, partition: int) -> bool:
        """Whether a record of ``topic``/``partition`` was processed since the last reset."""
        return (topic, partition) in self._offsets

    def read_up_to(self, topics: Iterable[str], partition: int, ts: float, now: float,
                   highwater: Callable[[str, int], int | None]) -> bool:
        """True if every topic's ``partition`` has been read past ``ts`` or to its end."""
        return all(self._past(topic, partition, ts, now, highwater) for topic in topics)

    def _past(self, topic: str, partition: int, ts: float, now: float,
              highwater: Callable[[str, int], int | None]) -> bool:
        tp = (topic, partition)
        # Strictly later: record timestamps have millisecond resolution, and a call of the session sent
        # in the same millisecond as its end may still be behind another session's record of that
        # millisecond (seen in bench.pipeline: 22 of 600 sessions built without their last call).
        if self._watermarks.get(tp, 0.0) > ts:
            return True
        end = highwater(topic, partition)
        last = self._offsets.get(tp)
        if last is not None:
            if end is None:
                return False
            return last + 1 >= end
        if end == 0:
            return True  # empty partition
        # Nothing delivered from it since the (re)start: once the worker has been active for settle_s,
        # whatever was there would have been delivered.
        return self.active_since is not None and now - self.active_since >= self.settle_s
