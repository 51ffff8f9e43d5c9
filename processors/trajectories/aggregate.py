"""The trajectory worker's logic: records in, table updates and trajectories out (no Faust in here).

:class:`SessionAggregator` is what the Faust agent calls for every batch of records, in partition order
(agent concurrency 1, so a session's state has a single writer). Tables are passed in as mappings
of bytes to bytes, so the same code runs on Faust tables (RocksDB) and on dicts in tests.

Life of a session: events arrive → one small :class:`~processors.trajectories.open_sessions.OpenSession`
value (times, the end, and the log offsets of its completions; the bytes are kept in a
:class:`~processors.trajectories.payloads.PayloadCache` and read back from the log on a miss) → on
``session.ended`` (once every input partition has been read up to that record) or at its deadline (a
timer asks through the control topic) the session is built (processors.trajectories.session_builds:
validated, deltas resolved, the spec's builder run, in a process pool when the app has one) and the
Trajectory is sent → when the broker has acknowledged it, the agent (before its next record: the tables
have one writer) deletes the session's entries and remembers its id in ``built``, with the last completion
offset its trajectory holds. A replayed record of a built session is dropped (``late``); a completion past
that offset is a call made after the build (a session with no spec built at its idle deadline, then
resumed): it is in no trajectory, so it is dead-lettered as ``late_call`` with the reason, never dropped
unseen (``rollwire rebuild`` builds the session whole from the log). Nothing is deleted before the trajectory is on the broker, so
a crash at any point leads to a rebuild from the same inputs, i.e. the same trajectory event id, which
readers de-duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from processors.trajectories.intake import completion_session, peek
from processors.trajectories.payloads import LogReadError, PayloadCache
from processors.trajectories.progress import InputProgress
from processors.trajectories.session_builds import BuildJob, BuildResult, InlineBuilds, SessionBuilds, TrajectoryRecord
from processors.trajectories.writebehind import BufferedTable
from processors.trajectories.writebehind import discard as discard_pending
from processors.trajectories.writebehind import flush as flush_tables
from processors.trajectories.open_sessions import (
    CallRef,
    EndFacts,
    OpenSession,
    SpecFacts,
    builder_name,
    deadline,
    facts,
)
from processors.worker.dead_letters import dead_letter
from schemas.codec import EventDecodeError, decode_event
from schemas.dead_letter import DeadLetter
from schemas.envelope import Event
from schemas.sessions import SessionEnded, SessionSpec
from schemas.topics import Topic, TopicRegistry
from schemas.transport import TransportError

logger = logging.getLogger(__name__)

Table = MutableMapping[bytes, bytes]


class Record(Protocol):
    """The parts of a Kafka record the aggregator reads (Faust's Message has them)."""

    topic: str
    partition: int
    offset: int
    timestamp: float
    key: bytes | None
    value: bytes | None
    headers: Any


@dataclass
class Tables:
    open: Table  # session id -> OpenSession
    specs: Table  # session id -> SpecFacts
    built: Table  # session id -> trajectory event id, and "@" the last completion offset it holds (built_entry)


@dataclass
class BufferedTables:
    """The same tables, writes held until the next flush."""

    open: BufferedTable
    specs: BufferedTable
    built: BufferedTable

    def __iter__(self) -> Iterator[BufferedTable]:
        return iter((self.open, self.specs, self.built))


@dataclass
class Outputs:
    """How the aggregator talks to Kafka; the app supplies these."""

    # Send a trajectory to the session's partition without waiting for the acknowledgement; once the
    # broker has it, call trajectory_recorded() (on failure, on_send_failed()).
    send_trajectory: Callable[[TrajectoryRecord, int], Awaitable[None]]
    send_dead_letter: Callable[[DeadLetter], Awaitable[None]]
    # Send a control record {kind, session_id, ...} to the session's partition of the control topic.
    send_control: Callable[[str, int, dict[str, Any]], Awaitable[None]]
    # The consumer's high watermark of (topic, partition), None if not known yet.
    highwater: Callable[[str, int], int | None]
    # Read completion records back from the log: (partition, offsets) -> {offset: value}, absent if gone
    # (retention); raises processors.trajectories.payloads.LogReadError when one still in the log cannot be read now.
    read_completions: Callable[[int, list[int]], Awaitable[dict[int, bytes]]]
    # The offset the consumer (re)started reading (topic, partition) from at the last assignment (the
    # group's committed offset), None if unknown. Without it, a partition with nothing processed since
    # the assignment counts as drained once the worker has been active for settle_s.
    read_from: Callable[[str, int], int | None] | None = None
    # Ask the broker the end offsets of these (topic, partition)s now. The consumer's high watermark is
    # only as fresh as its last fetch of a partition (a paused one is not fetched): a session's last call
    # can lie past it. With this, a partition counts as drained only by an end asked after the session's
    # end record was handled (processors.trajectories.progress); without it, by the high watermark.
    log_ends: Callable[[list[tuple[str, int]]], Awaitable[dict[tuple[str, int], int]]] | None = None


def built_value(event_id: str, upto: int | None) -> bytes:
    """A ``built`` table value: the trajectory's event id, and the last completion offset it holds."""
    return event_id.encode() if upto is None else f"{event_id}@{upto}".encode()


def built_entry(value: bytes) -> tuple[str, int | None]:
    """A ``built`` value read back: (event id, last completion offset or None: written before the offset
    was kept, when every later record of the session counts as late)."""
    text = value.decode("utf-8", errors="replace")
    event_id, _, upto = text.partition("@")
    return event_id, int(upto) if upto.lstrip("-").isdigit() else None


def _late_reason(session_id: str, event_id: str, upto: int, partition: int) -> str:
    return (f"a call of session {session_id!r} made after the session was built (trajectory {event_id}, which "
            f"holds its calls up to offset {upto} of partition {partition}): in no trajectory online; "
            "`rollwire rebuild` builds the session whole from the log")


class SessionAggregator:
    """Per-record handling, the control records, and the deadline scan the timer runs."""

    def __init__(self, tables: Tables, outputs: Outputs, registry: TopicRegistry, *, control_topic: str,
                 group: str, idle_s: float, grace_s: float, settle_s: float, max_message_bytes: int,
                 cache_bytes: int = 512 * 1024 * 1024, clock: Callable[[], float] = time.time,
                 builds: SessionBuilds | None = None, source: str = "processors", clock_skew_s: float = 0.05) -> None:
        self.tables = tables
        # Where sessions are built (processors.trajectories.session_builds): in place unless the app gives a pool.
        self.builds = builds if builds is not None else InlineBuilds()
        self.source = source
        # Every write goes through these; the app flushes them before acknowledging the records.
        self.t = BufferedTables(BufferedTable(tables.open), BufferedTable(tables.specs), BufferedTable(tables.built))
        self.out, self.registry = outputs, registry
        self.control_topic, self.group = control_topic, group
        self.idle_s, self.grace_s = idle_s, grace_s
        self.max_message_bytes = max_message_bytes
        self.clock = clock
        self.progress = InputProgress(settle_s, clock_skew_s)
        self.payloads = PayloadCache(cache_bytes)  # derived: the log is the fallback
        self.in_flight: set[str] = set()  # built and sent, not yet acknowledged (derived; reset on rebalance)
        self._built_upto: dict[str, int] = {}  # in flight: the last completion offset its build holds
        # Calls a session took while its build was in flight, in no trajectory: dead-lettered next.
        self._late_refs: list[tuple[str, str, int, list[CallRef]]] = []
        self._asked: dict[str, float] = {}  # control records recently sent, to not repeat them every tick
        # Trajectories the broker has acknowledged, (session id, partition, event id), not yet forgotten
        # by the agent (which does so before its next record; see trajectory_recorded).
        self._recorded: list[tuple[str, int, str]] = []
        self._handling = False  # the agent is in handle_batch (maybe awaiting a send): the timer waits
        # Ended sessions waiting for their partition's other inputs to be read up to the end record
        # (derived, reset on rebalance; after a restart the timer finds them in the table): session id ->
        # (the end record's timestamp, the worker clock when it was handled), in the order handled.
        # An OrderedDict: its oldest entry is found and removed in O(1) however many were removed before.
        self._waiting: dict[int, OrderedDict[str, tuple[float, float]]] = {}
        # Partitions whose oldest waiting session has no end asked from the broker since its end was
        # handled: the app asks at once (ask_wanted_ends), then sends a "recheck" control record to those
        # that are ready.
        self.ends_wanted: set[int] = set()
        self.ends_needed = asyncio.Event()
        # The open table in memory, parsed (see _sessions), and the specs' facts as they are read.
        self._open: dict[bytes, OpenSession] | None = None
        self._specs: dict[bytes, SpecFacts] = {}
        self._names = {t: registry.name(t) for t in Topic}
        self._topic_specs = {registry.name(t): registry.spec(t) for t in Topic}
        self._others = (self._names[Topic.COMPLETIONS], self._names[Topic.SESSIONS])
        self.counters = {"records": 0, "dead_lettered": 0, "late": 0, "trajectories": 0, "partial": 0,
                         "read_back": 0, "lost": 0, "unresolved": 0, "build_failures": 0,
                         "calls_after_build": 0, "ends_asked": 0, "late_calls": 0,
                         "builds_deferred": 0}

    # -- records -------------------------------------------------------------------------------------

    async def handle(self, record: Record) -> None:
        """Take one input record (any of the three input topics or the control topic) and write its
        effect through to the tables (tests and simple callers; the app batches and flushes itself)."""
        await self.handle_batch((record,))
        self.flush(lambda partition: True)

    def flush(self, enter_partition: Callable[[int], bool], keep: Callable[[int], bool] | None = None) -> int:
        """Apply the buffered table writes (see processors.trajectories.writebehind.flush)."""
        return flush_tables(self.t, enter_partition, keep)

    async def handle_batch(self, records: Sequence[Record]) -> None:
        """Take a batch of input records, in the order the stream delivered them.

        Each session the batch touches is read from the open table once and written back once, however
        many of its records the batch holds (a table write is a changelog record: per record it was the
        worker's largest cost). Sessions whose end is in and whose inputs are read up to it are built
        after the batch. A control record is applied in its place, after the state before it is written.
        """
        self._handling = True
        try:
            if self._recorded:
                self._forget_recorded()
            if self._late_refs:
                await self._dead_letter_late_refs()
            await self._handle_batch(records)
        finally:
            self._handling = False

    async def _handle_batch(self, records: Sequence[Record]) -> None:
        touched: dict[bytes, OpenSession] = {}
        partitions: set[int] = set()
        for record in records:
            self.counters["records"] += 1
            if record.topic == self.control_topic:
                self._stage(touched)
                await self._control(record)
                continue
            self.progress.saw(record.topic, record.partition, record.offset, record.timestamp)
            partitions.add(record.partition)
            spec = self._topic_specs.get(record.topic) or self.registry.by_name(record.topic)
            event: Event | None = None
            session_id = completion_session(record.value, record.key, record.headers) \
                if spec.topic is Topic.COMPLETIONS else None
            if session_id is None:  # not a completion, or not one its headers vouch for
                try:
                    session_id = peek(record.value, record.key, spec).session_id
                    event = None if spec.topic is Topic.COMPLETIONS else decode_event(record.value, spec)
                except EventDecodeError as exc:
                    await self._dead_letter(record, exc.error_type, exc.reason)
                    continue
            sid = session_id.encode()
            session = touched.get(sid) or self._sessions().get(sid)
            # An open session is not built; only a session's first record (or a late one) asks the table.
            if session is None and sid in self.t.built:
                if spec.topic is Topic.COMPLETIONS and await self._late_call(record, session_id, sid):
                    continue
                self.counters["late"] += 1  # a replay after a restart, or a record after the session was built
                continue
            now = self.clock()
            if isinstance(event, SessionSpec):
                facts_ = SpecFacts.of(event, now)
                self.t.specs.put(sid, facts_.dumps(), record.partition)
                self._specs[sid] = facts_
                continue
            if session is None:
                session = OpenSession(record.partition, (), now, now)
            elif record.partition != session.partition:
                # Keyed by the session but placed by hand elsewhere: its session reads its calls from one
                # partition, and this record's offset there would name another record.
                await self._dead_letter(record, "wrong_partition", f"session {session_id!r} is on partition "
                                        f"{session.partition}; this record is on {record.partition}")
                continue
            if spec.topic is Topic.COMPLETIONS:
                if session_id in self.in_flight:
                    self.counters["calls_after_build"] += 1
                    logger.warning("completion at %s[%d]@%d arrived after session %s was built; not in its "
                                   "trajectory (dead-lettered as late_call once that is recorded)", record.topic,
                                   record.partition, record.offset, session_id)
                assert record.value is not None  # completion_session and peek refuse a record without one
                self.payloads.put(record.partition, record.offset, record.value)
                session = session.with_call(record.offset, now)
            elif isinstance(event, SessionEnded):
                end = EndFacts.of(event, record.timestamp)
                session = session.ended(end, now)
                self._waiting.setdefault(session.partition, OrderedDict()).setdefault(session_id, (end.record_ts, now))
            else:
                session = session.touched(now)
            touched[sid] = session
        self._stage(touched)
        now = self.clock()
        for partition in sorted(partitions):
            if self._waiting.get(partition):
                await self._build_waiting(partition, now)

    def _stage(self, touched: dict[bytes, OpenSession]) -> None:
        """Stage the sessions a batch changed (one buffered table write each, applied by :meth:`flush`)."""
        for sid, session in touched.items():
            self._set_open(sid, session)
        touched.clear()

    async def _build_waiting(self, partition: int, now: float) -> None:
        waiting = self._waiting[partition]
        # Oldest end first (the order handled): a partition read up to a later end is read up to every
        # earlier one, by either rule, so the first session not ready yet stops the scan (checking them
        # all on every record cost O(n²), sorting them every batch O(n log n)).
        while waiting:
            session_id = next(iter(waiting))
            ts, seen_at = waiting[session_id]
            if not self._read_up_to(partition, ts, now, seen_at):
                self._want_ends(partition, seen_at)
                break
            del waiting[session_id]
            session = self._sessions().get(session_id.encode())
            if session is not None:
                await self._build(session_id, session, partial=False)

    def _want_ends(self, partition: int, since: float) -> None:
        """Want the broker's ends of ``partition`` if one of its inputs has none asked since ``since``
        (when the oldest waiting session's end was handled). The app asks at once, once for whatever is
        wanted meanwhile; then the stream's next records (or a "recheck" control record, on a partition
        with nothing more to deliver) move the session on."""
        if self.out.log_ends is None or partition in self.ends_wanted:
            return
        if any(self.progress.log_end(topic, partition, since) is None for topic in self._others):
            self.ends_wanted.add(partition)
            self.ends_needed.set()

    async def ask_wanted_ends(self, active_partitions: set[int]) -> set[int]:
        """Ask the broker where the wanted partitions (of ``active_partitions``) end; returns those whose
        oldest waiting session is ready now, to each of which the app sends a "recheck" control record
        (the agent builds what is ready there; a partition still reading gets there by its own records)."""
        partitions, self.ends_wanted = self.ends_wanted & active_partitions, set()
        self.ends_needed.clear()
        if not partitions or not await self._ask_ends(partitions):
            return set()
        now = self.clock()
        ready = set()
        for partition in partitions:
            oldest = next(iter(self._waiting.get(partition, OrderedDict()).values()), None)
            if oldest is not None and self._read_up_to(partition, oldest[0], now, oldest[1]):
                ready.add(partition)
        return ready

    def _ready(self, session_id: str, session: OpenSession, now: float) -> bool:
        assert session.end is not None
        # An end handled before this assignment (absent here) was on the broker before any end asked since.
        waiting = self._waiting.get(session.partition)
        seen_at = waiting[session_id][1] if waiting is not None and session_id in waiting else 0.0
        return self._read_up_to(session.partition, session.end.record_ts, now, seen_at)

    def _end_of(self, since: float) -> Callable[[str, int], int | None]:
        """Where each input partition ends, as asked since ``since`` (see Outputs.log_ends)."""
        if self.out.log_ends is None:
            return self.out.highwater
        return lambda topic, partition: self.progress.log_end(topic, partition, since)

    def _read_up_to(self, partition: int, ts: float, now: float, since: float) -> bool:
        """Whether the other inputs' ``partition`` is handled past a record stamped ``ts`` (the end's), or
        up to where it ended when the broker was asked after ``since``, when the session's end was
        handled (processors.trajectories.progress), and, for an input
        with nothing processed since the assignment, that nothing is waiting there: its records from the
        committed offset on are still to come (after a rebalance the small session events are read far
        ahead of the completions; seen: a session built from its first call only, its later calls read
        after the build)."""
        end_of = self._end_of(since)
        if self.out.read_from is not None:
            for topic in self._others:
                if self.progress.processed(topic, partition):  # processed since the assignment
                    continue
                start, end = self.out.read_from(topic, partition), end_of(topic, partition)
                # Records (or transaction markers, until a catch-up reads them back) are still to come.
                if start is not None and (end is None or end > start):
                    return False
        return self.progress.read_up_to(self._others, partition, ts, now, end_of)

    # -- building ------------------------------------------------------------------------------------

    async def _build(self, session_id: str, session: OpenSession, *, partial: bool) -> None:
        """Hand the session's build to ``self.builds`` (processors.trajectories.session_builds): its records are
        validated, its prompt deltas resolved and its builder run there, off this loop when the builds
        run in a pool; then :meth:`_built` dead-letters the calls left out and sends the trajectory."""
        if session_id in self.in_flight:
            return
        spec = self._spec(session_id.encode())
        try:
            calls = await self._payloads(session_id, session)
        except LogReadError as exc:
            # Built without them, the session would give a trajectory missing calls, with another event id
            # than any later build of it. Left open: the timer asks for its build again (see tick).
            self.counters["builds_deferred"] += 1
            logger.warning("session %s: its completions cannot be read back now, so its build waits: %s",
                           session_id, exc)
            return
        job = BuildJob(session_id, session.partition, builder_name(spec),
                       facts(session_id, session, spec, partial=partial), list(calls.items()), self.source)
        self.in_flight.add(session_id)
        self._built_upto[session_id] = max((ref.offset for ref in session.calls), default=-1)
        self.counters["trajectories"] += 1
        self.counters["partial"] += partial
        await self.builds.submit(job, self._built, self._build_failed)

    async def _built(self, job: BuildJob, result: BuildResult) -> None:
        """A build is done (maybe after a rebalance: the trajectory is sent all the same, its event id
        the one any rebuild of the same records gets)."""
        values = dict(job.calls)
        for rejected in result.rejected:
            error = EventDecodeError(rejected.error_type, rejected.reason)
            await self._dead_letter_value(job.session_id, rejected.ref, values[rejected.ref], error)
        self.counters["unresolved"] += result.unresolved
        await self.out.send_trajectory(result.trajectory, job.partition)

    async def _build_failed(self, job: BuildJob, exc: BaseException) -> None:
        self.counters["build_failures"] += 1
        self.on_send_failed(job.session_id)

    async def _payloads(self, session_id: str, session: OpenSession) -> dict[CallRef, bytes]:
        """Each completion record's value, from the cache or else read back from the log, in log order."""
        refs = session.calls
        values = {ref: self.payloads.get(ref.partition, ref.offset) for ref in refs}
        missing: dict[int, list[int]] = {}
        for ref, value in values.items():
            if value is None:
                missing.setdefault(ref.partition, []).append(ref.offset)
        for partition, offsets in missing.items():
            found = await self.out.read_completions(partition, offsets)
            self.counters["read_back"] += len(found)
            for offset in offsets:
                values[CallRef(partition, offset)] = found.get(offset)
        out: dict[CallRef, bytes] = {}
        for ref, value in values.items():
            if value is None:
                self.counters["lost"] += 1
                logger.error("session %s: completion at %s/%d is no longer in the log (retention?); built "
                             "without it", session_id, ref.partition, ref.offset)
            else:
                out[ref] = value
            # Built now: a rebuild (a failed send) reads the log; late records are evicted with age.
            self.payloads.discard(ref.partition, ref.offset)
        return out

    def on_send_failed(self, session_id: str) -> None:
        """The trajectory was not recorded: forget it was in flight so that the next tick retries."""
        self.in_flight.discard(session_id)
        self._built_upto.pop(session_id, None)
        self._asked.pop(session_id, None)

    # -- control records -----------------------------------------------------------------------------

    async def _control(self, record: Record) -> None:
        try:
            doc = orjson.loads(record.value or b"")
            kind, session_id = doc["kind"], doc["session_id"]
        except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
            kind = session_id = None
        if not isinstance(kind, str) or not isinstance(session_id, str):
            # The control topic is the worker's own, but anything with access can write to it: a record of
            # another shape (a number for a session id) is ignored, never the end of the agent.
            logger.warning("ignoring malformed control record at %s/%d", record.partition, record.offset)
            return
        if kind == "recheck":  # the broker's ends were asked for this partition (ask_wanted_ends)
            if self._waiting.get(record.partition):
                await self._build_waiting(record.partition, self.clock())
            return
        sid = session_id.encode()
        session = self._sessions().get(sid)
        if kind == "emitted":  # what workers before trajectory_recorded sent; still in retained logs
            self._forget_built(session_id, record.partition, str(doc.get("event_id", "")))
            return
        if session is None or sid in self.t.built or session_id in self.in_flight:
            return
        now = self.clock()
        if kind == "finalize" and session.end is not None and self._ready(session_id, session, now):
            await self._build(session_id, session, partial=False)
        elif kind == "deadline" and session.end is None and now >= self._deadline(sid, session):
            await self._build(session_id, session, partial=True)

    def _spec(self, sid: bytes) -> SpecFacts | None:
        spec = self._specs.get(sid)
        if spec is None:
            raw_spec = self.t.specs.get(sid)
            if raw_spec is not None:
                spec = self._specs[sid] = SpecFacts.loads(raw_spec)
        return spec

    def _deadline(self, sid: bytes, session: OpenSession) -> float:
        spec = self._spec(sid)
        since = self.progress.active_since if self.progress.active_since is not None else self.clock()
        return deadline(session, spec, idle_s=self.idle_s, grace_s=self.grace_s, active_since=since)

    def read_back(self, topic: str, partition: int, end: int) -> None:
        """The worker read ``topic``/``partition`` back from the log up to ``end`` (exclusive) and handled
        what it found: the offsets without a record there (transaction markers) are accounted for."""
        self.progress.accounted(topic, partition, end - 1)

    def trajectory_recorded(self, session_id: str, partition: int, event_id: str) -> None:
        """The broker has the session's trajectory (called from the send's callback, any time): the agent
        forgets the session before its next record. Until then it stays in flight (not built again).

        Applied by the agent, not here: a callback runs while the agent may be in the middle of a record
        of the same session (a late call), whose state it would write back after the deletion. Before,
        a control record ``emitted`` went through the broker and back for this: one more record per
        session through Faust's consumer path. With no record to come (a quiet partition), the timer's
        tick forgets them, between records."""
        self._recorded.append((session_id, partition, event_id))

    def _forget_recorded(self) -> None:
        recorded, self._recorded = self._recorded, []
        for session_id, partition, event_id in recorded:
            self._forget_built(session_id, partition, event_id)

    def _forget_built(self, session_id: str, partition: int, event_id: str) -> None:
        """Drop a session whose trajectory is on the broker; remember its event id in ``built``."""
        sid = session_id.encode()
        self.in_flight.discard(session_id)
        upto = self._built_upto.pop(session_id, None)
        session = self._sessions().get(sid)
        if upto is None and session is not None:  # built by a worker before this one (an "emitted" record)
            upto = max((ref.offset for ref in session.calls), default=-1)
        self.t.built.put(sid, built_value(event_id, upto), partition)
        if session is not None and upto is not None:
            later = [ref for ref in session.calls if ref.offset > upto]
            if later:  # taken while the build was in flight (calls_after_build): in no trajectory
                self._late_refs.append((session_id, event_id, upto, later))
        if session is not None:
            self.t.open.delete(sid, partition)
            self._del_open(sid)
        self.t.specs.delete(sid, partition)
        self._specs.pop(sid, None)

    # -- the timer -----------------------------------------------------------------------------------

    async def tick(self, active_partitions: set[int]) -> None:
        """Look at every open session of our partitions: ask for the build of those that are due.

        The timer cannot write tables (no current record), so it sends a control record to the
        session's partition and the agent acts on it.
        """
        if self._recorded and not self._handling:  # a quiet partition's last sessions (no record to come)
            self._forget_recorded()
            if self._late_refs:
                await self._dead_letter_late_refs()
        now = self.clock()
        if self.progress.active_since is None:
            self.progress.active_since = now
        due: list[tuple[str, OpenSession, str]] = []
        ended: list[tuple[str, OpenSession]] = []  # ended, not read up to their end yet
        for sid, session in list(self._sessions().items()):
            session_id = sid.decode()
            if session.partition not in active_partitions or session_id in self.in_flight:
                continue
            if now - self._asked.get(session_id, 0.0) < max(2.0, 4 * self.progress.settle_s):
                continue
            if session.end is not None:
                if self._ready(session_id, session, now):
                    due.append((session_id, session, "finalize"))
                else:
                    ended.append((session_id, session))
            elif now >= self._deadline(sid, session):
                due.append((session_id, session, "deadline"))
        if ended and await self._ask_ends({session.partition for _, session in ended}):
            due += [(session_id, session, "finalize") for session_id, session in ended
                    if self._ready(session_id, session, now)]
        for session_id, session, kind in due:
            self._asked[session_id] = now
            await self.out.send_control(session_id, session.partition, {"kind": kind, "session_id": session_id})

    async def _ask_ends(self, partitions: set[int]) -> bool:
        """Ask the broker where the other inputs' ``partitions`` end now (see Outputs.log_ends)."""
        if self.out.log_ends is None:
            return False
        asked_at = self.clock()  # before the request: the broker answers with its ends at or after this
        self.counters["ends_asked"] += 1
        try:
            ends = await self.out.log_ends([(topic, p) for topic in self._others for p in sorted(partitions)])
        except TransportError as exc:  # the next tick asks again
            logger.warning("cannot ask where partitions %s end: %r", sorted(partitions), exc)
            return False
        self.progress.asked_ends(ends, asked_at)
        return True

    def reset(self, partitions: set[int] | None = None) -> None:
        """Partitions were revoked or assigned: drop what was derived from the old assignment."""
        if partitions is not None:
            self.payloads.retain(partitions)
            # Still true of the partitions kept: forgotten by the first record handled after the recovery.
            self._recorded = [entry for entry in self._recorded if entry[1] in partitions]
            self._late_refs = [entry for entry in self._late_refs if entry[3][0].partition in partitions]
        self.progress.reset()
        self.in_flight.clear()
        self._built_upto.clear()
        self._asked.clear()
        self._waiting.clear()
        self.ends_wanted.clear()
        self._open = None
        self._specs.clear()
        discard_pending(self.t)

    def forget_cached(self) -> None:
        """Drop the in-memory copies of the tables (re-read on next use, pending writes included).

        Called when table recovery completes: a copy read while a changelog was still being read back
        (a timer's scan during a rebalance) holds old states of the moved sessions, and every later record
        of such a session would build on that old state (seen: a trajectory with only its first call)."""
        self._open = None
        self._specs.clear()

    def _sessions(self) -> dict[bytes, OpenSession]:
        """The open sessions of our partitions, in memory: read from the table once after each
        (re)assignment (iterating RocksDB per record or per tick cost more than the records), then kept
        current by every write."""
        if self._open is None:
            self._open = {sid: OpenSession.loads(raw) for sid, raw in self.t.open.items()}
        return self._open

    def _set_open(self, sid: bytes, session: OpenSession) -> None:
        self.t.open.put(sid, session.dumps(), session.partition)
        self._sessions()[sid] = session

    def _del_open(self, sid: bytes) -> None:
        self._sessions().pop(sid, None)

    # -- dead letters --------------------------------------------------------------------------------

    async def _late_call(self, record: Record, session_id: str, sid: bytes) -> bool:
        """Dead-letter a completion of a built session made after its build (past the last offset its
        trajectory holds); False for a replay of one it holds, or when that offset is not known."""
        event_id, upto = built_entry(self.t.built.get(sid) or b"")
        if upto is None or record.offset <= upto:
            return False
        self.counters["late_calls"] += 1
        await self._dead_letter(record, "late_call", _late_reason(session_id, event_id, upto, record.partition))
        return True

    async def _dead_letter_late_refs(self) -> None:
        """Dead-letter the calls sessions took while their builds were in flight (see _forget_built)."""
        pending, self._late_refs = self._late_refs, []
        for session_id, event_id, upto, refs in pending:
            values = {ref: self.payloads.get(ref.partition, ref.offset) for ref in refs}
            missing = [ref.offset for ref, value in values.items() if value is None]
            if missing:
                try:
                    found = await self.out.read_completions(refs[0].partition, missing)
                except LogReadError as exc:  # kept for the next record's turn
                    logger.warning("late calls of session %s cannot be read back now: %s", session_id, exc)
                    self._late_refs.append((session_id, event_id, upto, refs))
                    continue
                values.update({ref: found.get(ref.offset) for ref in refs if values[ref] is None})
            for ref, value in values.items():
                self.payloads.discard(ref.partition, ref.offset)
                if value is None:
                    self.counters["lost"] += 1
                    continue
                self.counters["late_calls"] += 1
                await self._dead_letter_value(session_id, ref, value, EventDecodeError("late_call", _late_reason(
                    session_id, event_id, upto, ref.partition)))

    async def _dead_letter(self, record: Record, error_type: str, reason: str) -> None:
        self.counters["dead_lettered"] += 1
        logger.warning("dead-lettering %s@%d/%d (%s: %s)", record.topic, record.partition, record.offset,
                       error_type, reason[:200])
        await self.out.send_dead_letter(dead_letter(
            topic=record.topic, partition=record.partition, offset=record.offset, key=record.key,
            value=record.value, headers=record.headers, group=self.group, error_type=error_type,
            reason=reason, max_message_bytes=self.max_message_bytes))

    async def _dead_letter_value(self, session_id: str, ref: CallRef, value: bytes,
                                 exc: EventDecodeError) -> None:
        self.counters["dead_lettered"] += 1
        logger.warning("dead-lettering a stored completion of %s (%s)", session_id, exc)
        await self.out.send_dead_letter(dead_letter(
            topic=self._names[Topic.COMPLETIONS], partition=ref.partition, offset=ref.offset,
            key=session_id.encode(), value=value, headers=None, group=self.group, error_type=exc.error_type,
            reason=f"{exc.reason} (found when session {session_id} was built)",
            max_message_bytes=self.max_message_bytes))
