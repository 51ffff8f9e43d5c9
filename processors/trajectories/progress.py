"""How far the worker has read each input partition: is everything a session's end came after in?

A session's completions, spec and end event sit on three topics; Faust reads their partitions
independently, so the end event can be read before the session's last completions (a replay after a
restart reads the small session events far ahead of the large completions). Whoever ends a session does
so once its calls are acknowledged (the gateway after the harness is done; the proxy answers a call's
end only after its ack), so every record the end came after was on the log when the end was handled.
Before a session is built, its partition of each other input must be handled up to the end, by either
of two rules (:meth:`InputProgress.read_up_to`):

- **An end asked after the end was handled.** The worker asks the broker where the partition ends,
  *after* it handled the end (:meth:`InputProgress.asked_ends`), and waits until it has handled every
  offset below that. No clock is compared. But the worker asks "now": a worker behind its producers (a
  flood) waits for everything written meanwhile too, so built this way alone the trajectories come
  slower (bench.pipeline measures the throughput).
- **A record stamped later.** A record stamped more than ``clock_skew_s`` after the end was handled
  there: it was written after the end, so after the session's calls. Record timestamps come from the
  producers' machines; the margin is how far their clocks may disagree (even with one clock, a
  session's last call can sit behind another session's record of the same millisecond). The default is
  for machines kept in step by NTP; a larger margin holds a flood's sessions longer, at a cost in
  throughput that bench.pipeline measures.

The consumer's own high watermark is no substitute for an asked end: it is only as fresh as its last
fetch of that partition, and a paused partition, or one with fetched records still buffered, is not
fetched (trusted, it built sessions without some of their calls in bench.pipeline after a broker
restart).

A transactional producer's commit (or abort) marker takes an offset no consumer ever sees, so a partition
whose last record came from a transaction stays one or a few offsets short of its end. The worker's
catch-up reads such an end back from the log (processors.trajectories.continuity) and reports the offsets it found no
record at (:meth:`InputProgress.accounted`). This is derived from the stream, kept in memory, and reset
at every rebalance.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Mapping

# Ends asked are kept per partition for the sessions still waiting (asked every few ms in a flood): a
# session uses the first end asked after its end was handled, not the newest, which a worker behind the
# producers would never reach. Older ones are dropped; a session older than all of them uses the oldest.
ASKED_ENDS_KEPT = 512


class InputProgress:
    """Per (topic, partition): the last offset processed, and the ends asked from the broker."""

    def __init__(self, settle_s: float, clock_skew_s: float = 0.05) -> None:
        self.settle_s = settle_s
        self.clock_skew_s = clock_skew_s
        self._offsets: dict[tuple[str, int], int] = {}
        self._watermarks: dict[tuple[str, int], float] = {}  # the latest record timestamp handled
        # (worker-clock time asked, end offset), oldest first.
        self._log_ends: dict[tuple[str, int], deque[tuple[float, int]]] = {}
        self.active_since: float | None = None

    def reset(self) -> None:
        """Forget everything (partitions were revoked or assigned)."""
        self._log_ends.clear()
        self._offsets.clear()
        self._watermarks.clear()
        self.active_since = None

    def saw(self, topic: str, partition: int, offset: int, timestamp: float) -> None:
        """A record of ``topic``/``partition`` at ``offset``, stamped ``timestamp``, was handled."""
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
            asked = self._log_ends.setdefault(tp, deque(maxlen=ASKED_ENDS_KEPT))
            if asked and asked[-1][0] > asked_at:  # an older request answered late: keep the order
                continue
            asked.append((asked_at, end))

    def log_end(self, topic: str, partition: int, since: float) -> int | None:
        """The partition's end offset as the broker gave it to the first request sent at or after
        ``since``; None if none was asked since (an end from before a record was handled may not hold
        it)."""
        asked = self._log_ends.get((topic, partition))
        if not asked or asked[-1][0] < since:
            return None
        first = bisect.bisect_left(asked, since, key=lambda entry: entry[0])
        return asked[first][1]

    def processed(self, topic: str, partition: int) -> bool:
        """Whether a record of ``topic``/``partition`` was processed since the last reset."""
        return (topic, partition) in self._offsets

    def read_up_to(self, topics: Iterable[str], partition: int, ts: float, now: float,
                   end_of: Callable[[str, int], int | None]) -> bool:
        """True if every topic's ``partition`` is handled past a record stamped ``ts`` (by more than the
        clock skew), or up to the end ``end_of`` gives."""
        return all(self._handled_to(topic, partition, ts, now, end_of) for topic in topics)

    def _handled_to(self, topic: str, partition: int, ts: float, now: float,
                    end_of: Callable[[str, int], int | None]) -> bool:
        if self._watermarks.get((topic, partition), 0.0) > ts + self.clock_skew_s:
            return True
        end = end_of(topic, partition)
        if end is None:
            return False
        last = self._offsets.get((topic, partition))
        if last is not None:
            return last + 1 >= end
        if end == 0:
            return True  # empty partition
        # Nothing delivered from it since the (re)start: once the worker has been active for settle_s,
        # whatever was there would have been delivered (the app also checks the committed offset).
        return self.active_since is not None and now - self.active_since >= self.settle_s
