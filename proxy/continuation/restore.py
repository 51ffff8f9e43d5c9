"""Branches read back from the log: a session's calls that another process served (or this process before
it was started again) are replayed into this process's branches before the session's next call is placed.

The branch is a view of ``completions``: every served call's event holds its prompt and sampled ids (as a
delta against its branch's previous event, or whole), its messages, its branch and how it was placed. A
process knows from the claims log (:mod:`proxy.tier.claims`) which of a session's calls it did not serve;
when one of those came before the call it is about to place and is not yet in its branches, it reads the
session's partition of ``completions`` and replays the session's events it has not seen, in log order
(:meth:`proxy.continuation.branches.BranchStore.replay`), resolving deltas against the branches' last
events and each other.

Where it reads (the index): the session's partition only (completions are keyed by session), from the
first record at the earliest unaccounted call's claim time (less a margin for clocks; the broker's time
index finds the offset), or from where this process's last read of that session's partition ended,
whichever is later; up to the partition's end when the read began. A session served by one process all
along costs nothing; one that changes process costs one read of the partition since its calls moved.

A read that fails or takes longer than ``timeout_s`` leaves the branches as they are and says why
(:class:`RestoreOutcome`): the call is then rendered whole and its event names the reason, never failed for
it. A call of the session that another process claimed but whose event never came (that process died with
the call in flight) is given up once it is older than ``give_up_s``: no event will ever name it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiokafka import TopicPartition

from proxy.session_registry import LiveSession
from proxy.tier.claims import CLOCK_MARGIN_MS, SessionClaims
from schemas.codec import EventDecodeError, decode_event
from schemas.completions import Completion
from schemas.prompt_chain import MissingPromptParent, PromptChains
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from schemas.transport.errors import TransportError

logger = logging.getLogger(__name__)

_CHAIN_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RestoreOutcome:
    """One read of a session's log: what it cost and what it found (``failed``: why the branches may still
    be behind; the call is then rendered whole)."""

    seconds: float
    bytes_read: int
    records_read: int
    replayed: int
    failed: str | None = None


class BranchRestorer:
    """Reads sessions' completions back into their branches (a small pool of manually assigned readers)."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float, give_up_s: float, readers: int = 2) -> None:
        self.kafka = kafka
        self.timeout_s = timeout_s
        self.give_up_s = give_up_s
        self._spec = kafka.registry().spec(Topic.COMPLETIONS)
        self._free: asyncio.Queue[EventConsumer | None] = asyncio.Queue()
        for _ in range(readers):
            self._free.put_nowait(None)  # a reader made when first needed
        self._made: list[EventConsumer] = []

    async def stop(self) -> None:
        for reader in self._made:
            await reader.stop()
        self._made.clear()

    @staticmethod
    def behind(session: LiveSession, claims: SessionClaims, before: int) -> list[int]:
        """The calls numbered before ``before`` that another process claimed and that this process's
        branches do not hold yet (cheap: no I/O)."""
        return [s for s in claims.foreign if s < before and s not in session.replayed]

    async def catch_up(self, session: LiveSession, claims: SessionClaims, before: int) -> RestoreOutcome | None:
        """Bring ``session``'s branches up to the log for every call numbered before ``before``; None when
        they already are. Serialized per session, so a session's calls never replay the same events twice."""
        if not self.behind(session, claims, before):
            return None
        async with session.restore_lock:
            missing = self.behind(session, claims, before)
            if not missing:
                return None
            started = time.perf_counter()
            try:
                async with asyncio.timeout(self.timeout_s):
                    outcome = await self._read(session, claims, missing, started)
            except TimeoutError:
                outcome = RestoreOutcome(time.perf_counter() - started, 0, 0, 0, "restore_timed_out")
            except TransportError as exc:
                logger.warning("session %s: its log could not be read (%s)", session.session_id, exc)
                outcome = RestoreOutcome(time.perf_counter() - started, 0, 0, 0, "restore_failed")
            self._give_up(session, claims, before)
            return outcome

    def _give_up(self, session: LiveSession, claims: SessionClaims, before: int) -> None:
        """Calls claimed long ago whose events never came: their process died with them in flight."""
        oldest = time.time() * 1000 - self.give_up_s * 1000
        for sequence in self.behind(session, claims, before):
            if claims.foreign[sequence].timestamp_ms < oldest:
                session.replayed.add(sequence)

    async def _read(self, session: LiveSession, claims: SessionClaims, missing: list[int],
                    started: float) -> RestoreOutcome:
        reader = await self._reader()
        try:
            outcome = await self._scan(reader, session, claims, missing, started)
        except BaseException:
            # A reader cut mid-read (a timeout) may hold a fetch for the old position: the next read makes a
            # fresh one in its place.
            self._made.remove(reader)
            self._free.put_nowait(None)
            await reader.stop()
            raise
        self._free.put_nowait(reader)
        return outcome

    async def _reader(self) -> EventConsumer:
        reader = await self._free.get()
        if reader is None:
            reader = EventConsumer(self.kafka, [self._spec], group_id=None, service="proxy-restore", manual=True,
                                   dead_letters=False, dedupe_window=0)
            try:
                await reader.start()
            except BaseException:
                self._free.put_nowait(None)
                raise
            self._made.append(reader)
        return reader

    async def _scan(self, reader: EventConsumer, session: LiveSession, claims: SessionClaims, missing: list[int],
                    started: float) -> RestoreOutcome:
        tp = TopicPartition(self._spec.name, session.partition(self._spec.partitions))
        reader.assign([tp])
        end = (await reader.end_offsets([tp]))[tp]
        since = min(claims.foreign[s].timestamp_ms for s in missing) - CLOCK_MARGIN_MS
        await reader.seek_to_time(since, [tp])
        position = await reader.position(tp)
        if session.log_read_to is not None and session.log_read_to > position:
            reader.seek(tp, session.log_read_to)
        key = session.session_id.encode("utf-8")
        found: list[Completion] = []
        read_bytes = records = 0
        while await reader.position(tp) < end:
            for record in await reader.getmany_raw(200, partitions=[tp]):
                if record.offset >= end:
                    continue
                records += 1
                read_bytes += len(record.value or b"")
                if record.key != key:
                    continue
                try:
                    event = decode_event(record.value, self._spec)
                except EventDecodeError as exc:
                    logger.warning("session %s: skipping %s@%d: %s", session.session_id, tp, record.offset, exc)
                    continue
                if isinstance(event, Completion) and event.session_id == session.session_id:
                    found.append(event)
        session.log_read_to = end
        replayed = self._replay(session, claims, found)
        return RestoreOutcome(time.perf_counter() - started, read_bytes, records, replayed)

    @staticmethod
    def _replay(session: LiveSession, claims: SessionClaims, found: list[Completion]) -> int:
        """Replay the events this process has not seen, in log order, deltas resolved against the branches'
        last events and each other."""
        chains = PromptChains(_CHAIN_CACHE_BYTES)
        for link in session.branches.links():
            chains.remember(link)
        replayed = 0
        for event in found:
            try:
                full = chains.resolve(event)
            except MissingPromptParent as exc:
                logger.warning("session %s: call %d cannot be restored: %s", session.session_id, event.sequence,
                               exc.reason)
                continue
            if event.sequence in claims.own or event.sequence in session.replayed:
                continue
            session.replayed.add(event.sequence)
            if session.branches.replay(full, chains.link(full.event_id)):
                replayed += 1
        return replayed
