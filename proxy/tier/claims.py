"""Call numbers for a tier of proxy processes: claimed on ``call-claims``, derived from the log's order.

Every process appends a :class:`~schemas.call_claims.CallClaim` before it numbers a call and follows the
whole topic (:class:`CallNumbers`). A call's number is the count of its session's claims before its own
on the session's partition, so every process derives the same numbers, whichever of them served the calls,
and a process started again continues from the log instead of from 0. The claiming call waits until this
process's reader has passed its own claim: then every earlier claim of the session is counted.

What a process learns about the calls it did not serve (:class:`SessionClaims.foreign`) is what tells it
that its branches of the session may be behind the log (:mod:`proxy.continuation.restore` reads them back
before the session's next call is placed).

Where the reader starts: the session registry's view of the live sessions says since when their claims can
matter (the earliest first-seen spec of a session that has not ended, less :data:`CLOCK_MARGIN_MS`); with
none live, from a little before now. Claims of ended sessions are never needed: their calls are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from proxy.capture import Recorder
from proxy.errors import CaptureFailed
from proxy.follow import follow_forever
from schemas.call_claims import CallClaim
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings, Received

CLOCK_MARGIN_MS = 5 * 60 * 1000
"""How far before a time the claims or completions are read from, for clocks of different hosts."""

_RECENT_DIGESTS = 32


@dataclass(frozen=True, slots=True)
class ForeignClaim:
    """A call of the session that another process (or an earlier run of this one) numbered."""

    sequence: int
    proxy: str
    timestamp_ms: int


@dataclass
class SessionClaims:
    """One session's calls as the claims log numbers them."""

    count: int = 0
    recent: OrderedDict[str, int] = field(default_factory=OrderedDict)  # body digest -> first call's number
    own: set[int] = field(default_factory=set)  # numbers this process claimed
    foreign: dict[int, ForeignClaim] = field(default_factory=dict)  # not yet accounted for by this process

    def number(self, digest: str | None, retry_count: int) -> tuple[int, int | None]:
        """The next claim's number; for an SDK retry of an earlier identical body, that call's number too."""
        sequence = self.count
        self.count += 1
        retry_of = self.recent.get(digest) if digest is not None and retry_count > 0 else None
        if digest is not None:
            self.recent[digest] = sequence if retry_of is None else retry_of
            self.recent.move_to_end(digest)
            while len(self.recent) > _RECENT_DIGESTS:
                self.recent.popitem(last=False)
        return sequence, retry_of


@dataclass(frozen=True, slots=True)
class Numbered:
    """A claimed call's number, where its claim is, and whether it retries an earlier call."""

    sequence: int
    retry_of: int | None
    partition: int
    offset: int


class CallNumbers:
    """Claims call numbers for this process and follows every process's claims.

    ``live_since`` answers, once the session registry has caught up, the earliest time (ms) whose claims can
    still matter (see the module docstring), or None to read the whole topic.
    """

    def __init__(self, kafka: KafkaSettings, recorder: Recorder, proxy: str, timeout_s: float,
                 live_since: Callable[[], Awaitable[int | None]] | None = None) -> None:
        self.kafka = kafka
        self.recorder = recorder
        self.proxy = proxy
        self.incarnation = uuid.uuid4().hex[:16]
        self.timeout_s = timeout_s
        self._live_since = live_since
        self._sessions: dict[str, SessionClaims] = {}
        self._waiting: dict[tuple[int, int], asyncio.Future[tuple[int, int | None]]] = {}
        self._positions: dict[TopicPartition, int] = {}
        self._task: asyncio.Task[None] | None = None
        self.read = 0

    def start(self) -> None:
        self._task = asyncio.create_task(follow_forever(self._follow, "the call claims reader"),
                                         name="rollwire-call-claims")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def of(self, session_id: str) -> SessionClaims:
        """The session's claims as read so far (empty for a session with none)."""
        claims = self._sessions.get(session_id)
        if claims is None:
            claims = self._sessions[session_id] = SessionClaims()
        return claims

    def calls(self, session_id: str) -> int:
        """How many calls of the session have been numbered (by any process) as far as this one has read."""
        claims = self._sessions.get(session_id)
        return claims.count if claims is not None else 0

    async def claim(self, session_id: str, digest: str | None, retry_count: int) -> Numbered:
        """Number one call of ``session_id``: append its claim and wait until the reader has counted it.
        CaptureFailed (retryable) when the claim cannot be written or read back in time."""
        claim = CallClaim(session_id=session_id, proxy=self.proxy, incarnation=self.incarnation,
                          request_digest=digest, retry_count=retry_count)
        written = await self.recorder.record(claim)
        where = (written.partition, written.offset)
        waiting = self._waiting.setdefault(where, asyncio.get_running_loop().create_future())
        try:
            async with asyncio.timeout(self.timeout_s):
                sequence, retry_of = await waiting
        except TimeoutError as exc:
            raise CaptureFailed(f"the call's number could not be read back from Kafka within {self.timeout_s:g} s; "
                                "retry shortly") from exc
        finally:
            self._waiting.pop(where, None)
        return Numbered(sequence, retry_of, written.partition, written.offset)

    # -- the reader ------------------------------------------------------------------------------------
    async def _follow(self) -> None:
        async with EventConsumer(self.kafka, [Topic.CALL_CLAIMS], group_id=None, service="proxy-claims",
                                 dead_letters=False) as consumer:
            partitions = await consumer.wait_for_assignment()
            if self._positions:
                for tp in partitions:
                    if tp in self._positions:
                        consumer.seek(tp, self._positions[tp])
            else:
                since = await self._start_ms()
                if since is not None:
                    await consumer.seek_to_time(since, partitions)
            while True:
                for received in await consumer.getmany(timeout_ms=500):
                    self._take(received)

    def _take(self, received: Received) -> None:
        """One record of the topic, in the partition's order: counted, and the reader's position past it."""
        event = received.event
        if isinstance(event, CallClaim):
            self._count(event, received.partition, received.offset, received.timestamp_ms)
        self._positions[TopicPartition(received.topic, received.partition)] = received.offset + 1

    async def _start_ms(self) -> int | None:
        if self._live_since is None:
            return None
        since = await self._live_since()
        return None if since is None else since - CLOCK_MARGIN_MS

    def _count(self, claim: CallClaim, partition: int, offset: int, timestamp_ms: int | None) -> None:
        self.read += 1
        session = self.of(claim.session_id)
        sequence, retry_of = session.number(claim.request_digest, claim.retry_count)
        if claim.incarnation == self.incarnation:
            session.own.add(sequence)
            waiting = self._waiting.get((partition, offset))
            if waiting is None:
                waiting = self._waiting[(partition, offset)] = asyncio.get_running_loop().create_future()
            if not waiting.done():
                waiting.set_result((sequence, retry_of))
        else:
            session.foreign[sequence] = ForeignClaim(sequence, claim.proxy,
                                                     timestamp_ms if timestamp_ms is not None else _now_ms())


def _now_ms() -> int:
    return int(time.time() * 1000)
