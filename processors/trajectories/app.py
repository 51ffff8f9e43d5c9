"""The trajectory worker, a Faust app: completions + session events in, one Trajectory per session out.

Top to bottom: settings, the app, topics, tables, the agent, the timer, the health page. The logic is
in processors/trajectories/aggregate.py (records → tables → builds); this module only wires it to Faust. Run it with
``rollwire processors`` (which creates the topics first). Configuration: ``ROLLWIRE_*`` (Kafka, see
schemas.transport.KafkaSettings) and ``ROLLWIRE_PROCESSORS_*`` (see processors.trajectories.settings).

Delivery is at least once (Faust's default; its exactly-once mode is deliberately not used): offsets
are committed after the producer is flushed, a trajectory's session is forgotten only after the broker
has the trajectory, and a rebuilt trajectory has the same event id, which readers de-duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import weakref

import faust
import orjson
from faust.streams import _current_event  # what Faust tables read a write's partition from
from faust.types import TP, RecordMetadata, TableT

from processors.trajectories.aggregate import Outputs, Record, SessionAggregator, Tables
from processors.trajectories.continuity import DUPLICATE, Gap, InputContinuity, RangeReader
from processors.worker.faust_worker import (
    RAW,
    app_settings,
    on_partitions,
    on_signal,
    send_event,
    tables_recovered,
    worker_app,
)
from processors.worker.changelogs import changelog_configs
from processors.worker.health import serve_health
from processors.trajectories.payloads import LogReader
from processors.trajectories.build_processes import PooledBuilds
from processors.trajectories.session_builds import InlineBuilds, SessionBuilds, TrajectoryRecord
from processors.trajectories.settings import ProcessorSettings
from processors.trajectories.topics import TABLES, app_id, control_topic
from schemas.dead_letter import DeadLetter
from schemas.topics import Topic
from schemas.transport import TransportError
from schemas.transport.settings import KafkaSettings

logger = logging.getLogger(__name__)

kafka = KafkaSettings()
conf = ProcessorSettings()
registry = kafka.registry()
SOURCE = f"processors@{socket.gethostname()}:{os.getpid()}"
PARTITIONS = kafka.session_partitions

app = worker_app(
    app_id(kafka, conf.app_id),
    **app_settings(kafka, store=conf.store, data_dir=conf.data_dir, partitions=PARTITIONS,
                   session_timeout_s=conf.session_timeout_s),
    producer_compression_type=None if conf.compression == "none" else conf.compression,
    producer_linger=0.005,  # batch the changelog writes: one produce request per record costs more CPU
    producer_max_batch_size=1024 * 1024,  # aiokafka's 16 kB default put every trajectory in its own batch
    # Faust waits, when partitions are revoked, for every record handed to a stream to be acknowledged,
    # before it sends the revocation signal. This agent acknowledges a record only once its table writes
    # are flushed (on that signal, see _revoked), and may hold records it has not handled yet: the wait
    # would never end (the rebalance hung until the member was thrown out). Not waiting is safe here: a
    # record not acknowledged is not committed, and its partition's next owner reads it again.
    stream_wait_empty=False,
)

# Our topics are declared as external: Faust reads and writes them but never creates or reconfigures them.
inputs = app.topic(registry.name(Topic.COMPLETIONS), registry.name(Topic.SESSION_EVENTS),
                   registry.name(Topic.SESSIONS), control_topic(kafka, conf.app_id),
                   partitions=PARTITIONS, internal=False, **RAW)
trajectories = app.topic(registry.name(Topic.TRAJECTORIES), internal=False, **RAW)
dead_letters = app.topic(registry.name(Topic.DEAD_LETTER), internal=False, **RAW)
control = app.topic(control_topic(kafka, conf.app_id), partitions=PARTITIONS, internal=False, **RAW)


def _table(name: str, help: str) -> TableT[bytes, bytes]:
    return app.Table(name, partitions=PARTITIONS, extra_topic_configs=changelog_configs(kafka), help=help,
                     key_type=bytes, value_type=bytes, schema=faust.Schema(**RAW))


OPEN, SPECS, BUILT = TABLES  # their changelogs are created before the worker starts (processors.trajectories.topics)
tables = Tables(
    open=_table(OPEN, "session id -> OpenSession (small)"),
    specs=_table(SPECS, "session id -> SpecFacts"),
    built=_table(BUILT, "session id -> trajectory event id"),
)


async def send_trajectory(trajectory: TrajectoryRecord, partition: int) -> None:
    """Send a built trajectory (encoded where it was built) to the session's partition; once the broker
    has it, the agent forgets the session (SessionAggregator.trajectory_recorded)."""
    future = await trajectories.send(key=trajectory.key, value=trajectory.value, headers=trajectory.headers,
                                     partition=partition)
    assert isinstance(future, asyncio.Future)  # declared as a bare Awaitable: the producer's future

    def done(fut: asyncio.Future[RecordMetadata]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            logger.error("trajectory %s of %s not recorded: %r", trajectory.event_id, trajectory.session_id,
                         None if fut.cancelled() else fut.exception())
            aggregator.on_send_failed(trajectory.session_id)
            return
        aggregator.trajectory_recorded(trajectory.session_id, partition, trajectory.event_id)

    future.add_done_callback(done)


async def send_dead_letter(letter: DeadLetter) -> None:
    await (await send_event(dead_letters, letter, SOURCE))


async def send_control(session_id: str, partition: int, record: dict) -> None:
    await control.send(key=session_id.encode(), value=orjson.dumps(record), partition=partition)


log_reader = LogReader(kafka.kafka_bootstrap, registry.name(Topic.COMPLETIONS), fetch_bytes=kafka.fetch_bytes)


def highwater(topic: str, partition: int) -> int | None:
    try:
        return app.consumer.highwater(TP(topic, partition))
    except Exception:  # not assigned (yet) or not fetched: unknown
        return None


INPUT_TOPICS = {registry.name(Topic.COMPLETIONS): Topic.COMPLETIONS,
                registry.name(Topic.SESSION_EVENTS): Topic.SESSION_EVENTS,
                registry.name(Topic.SESSIONS): Topic.SESSIONS,
                control_topic(kafka, conf.app_id): Topic.SESSION_EVENTS}
# The session inputs, whose ends a catch-up reads back (the control topic's own records are not state).
SESSION_INPUTS = frozenset(name for name, topic in INPUT_TOPICS.items() if name != control_topic(kafka, conf.app_id))
CATCH_UP = b'"kind":"catch_up"'
continuity = InputContinuity()
range_reader = RangeReader(kafka, INPUT_TOPICS)
# When a catch-up was last asked for each partition (see deadlines).
catch_up_asked: dict[int, float] = {}


async def _baseline() -> None:
    """Ask the group's committed offsets of our input partitions (where this assignment starts reading)."""
    generation = assignments[0]
    assigned = [(tp.topic, tp.partition) for tp in app.assignor.assigned_actives() if tp.topic in INPUT_TOPICS]
    try:
        committed = await range_reader.committed(app.conf.id, assigned)
    except TransportError as exc:  # go on trusting the stream; asked again at the next assignment
        logger.error("cannot read the committed offsets: %s; skipped offsets go undetected until the next "
                     "assignment", exc)
        committed = {}
    if assignments[0] == generation:  # else they are another assignment's: asked again
        continuity.baseline(committed)


# Session builds (validation, delta resolution, the builder, encoding: the worker's largest cost per
# session) run in build processes while the agent goes on reading records (processors.trajectories.build_processes),
# or in place with none.
builds: SessionBuilds = PooledBuilds(conf.build_processes) if conf.build_processes else InlineBuilds()
aggregator = SessionAggregator(
    tables, Outputs(send_trajectory, send_dead_letter, send_control, highwater, log_reader.read, continuity.committed,
                    range_reader.end_offsets),
    registry,
    control_topic=control_topic(kafka, conf.app_id), group=app.conf.id, idle_s=conf.idle_s,
    grace_s=conf.grace_s, settle_s=conf.settle_s, max_message_bytes=kafka.max_message_bytes,
    cache_bytes=conf.cache_mb * 1024 * 1024, builds=builds, source=SOURCE, clock_skew_s=conf.clock_skew_s)


# Records handled whose effect on the tables is still only in memory: acknowledged after the next flush.
unflushed: list[faust.EventT] = []
# How many times partitions were revoked or assigned (a batch handled across one is dropped, see sessions).
assignments = [0]
# Assigned, tables not recovered yet (set by _assigned, cleared when Faust says recovery is complete).
# Faust's own signs are not enough: its ``completed`` event is never cleared after the first recovery, and
# a recovery finishing while the next rebalance starts sets ``app.rebalancing`` back to False.
recovering = [False]


async def flush() -> None:
    """Write the buffered table changes, wait until the broker has their changelog records, then
    acknowledge the records they came from.

    A table write finds its partition (RocksDB store, changelog partition) through the current event:
    for each partition one of its unflushed records is made current while its writes are applied. Every
    record on partition P of an input (and every control record sent there) concerns sessions of
    partition P, so that is where their state belongs.

    The wait matters: an acknowledged record's offset may be committed at any time, and Faust leaves the
    group at a stop before it flushes its producer. Acknowledged before its changelog record was on the
    broker, a record's effect could be missing from the table the partition's next owner recovers while
    the record itself is never read again (seen in a two-worker rebalance: completions lost).
    """
    if not unflushed:
        return
    events = list(unflushed)
    unflushed.clear()
    latest = {event.message.partition: event for event in events}

    def enter(partition: int) -> bool:
        event = latest.get(partition)
        if event is None:
            return False
        _current_event.set(weakref.ref(event))
        return True

    generation = assignments[0]
    # A write of a partition still ours with no unflushed record here was staged by the record the agent
    # is handling right now (this flush runs on the timer while the agent awaits a send or a log read):
    # it stays pending for the flush that acknowledges that record. Dropped, the record would be
    # acknowledged without it, and after the next reassignment (which re-reads the table) the session
    # would have lost it: seen as a trajectory missing calls after a two-worker rebalance.
    ours = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == control.get_topic_name()}
    try:
        aggregator.flush(enter, keep=ours.__contains__)
    finally:
        _current_event.set(None)
    await drain_changelog_buffer()
    await app.producer.flush()
    if assignments[0] != generation:
        return  # reassigned meanwhile: the records are read again by their partitions' owners
    for event in events:
        event.ack()


async def drain_changelog_buffer() -> None:
    """Wait until Faust's producer buffer (the changelog records of table writes) has handed every record
    to the Kafka producer. Its own ``flush`` waits for each record separately (an event and a
    ``wait_for`` task apiece, for every record, on the worker's CPU); the buffer's sender empties it
    in a step or two, so a short poll is enough."""
    buffer = app.producer.buffer
    spins = 0
    while buffer.size:
        spins += 1
        if spins == 5000:  # about 5 s: say so, and go on waiting (acknowledging now could lose writes)
            logger.warning("%d table writes still wait to be handed to the producer", buffer.size)
        await asyncio.sleep(0 if spins < 8 else 0.001)


@app.agent(inputs, concurrency=1)
async def sessions(stream: faust.StreamT) -> None:
    """Every input record, in partition order, one at a time (the single writer of the tables).

    One at a time on purpose: a table read finds its partition's store through the current event, which
    the stream sets to the record it hands out (records taken in batches of several partitions read the
    wrong partition's store: seen as sessions built twice in a two-worker run). Acknowledgements are
    manual: a record is acknowledged (and its offset may be committed) only after it is handled and the
    table writes it caused are flushed and on the broker, every ``batch_records`` records or
    ``batch_ms``, whichever comes first. A session's state is written once per flush however many of
    its records came in.

    Each partition is handled from the group's committed offset without holes or repeats
    (processors.trajectories.continuity): a record handed out again is skipped, records the stream skipped are read
    back from the log and handled first, and nothing is handled while the tables are being recovered.
    """
    assert isinstance(stream, faust.Stream)  # declared as StreamT, which has no noack()
    async for event in stream.noack().events():
        if conf.transport_only:  # benchmarks: what Faust and the broker cost with no work done
            aggregator.counters["records"] += 1
            unflushed.append(event)
            continue
        generation = assignments[0]
        message = event.message
        if recovering[0]:
            continue  # its state is not recovered yet: read back after recovery (processors.trajectories.continuity)
        if not continuity.baselined:
            await _baseline()
            if assignments[0] != generation:
                continue
        now = asyncio.get_running_loop().time()
        verdict = continuity.admit(message.topic, message.partition, message.offset, now)
        if verdict == DUPLICATE:
            unflushed.append(event)  # handled already (or before the committed offset): acknowledge only
            continue
        records: list[Record] = [message]
        if isinstance(verdict, Gap):
            try:
                records = [*await range_reader.read(verdict), message]
            except TransportError as exc:
                logger.error("offsets %s-%s of %s[%s] were skipped by the stream and cannot be read back: %s",
                             verdict.start, verdict.end - 1, verdict.topic, verdict.partition, exc)
                continue  # not acknowledged: the partition's next owner (or this one after a restart) reads it
            if assignments[0] != generation:
                continue
            logger.warning("offsets %s-%s of %s[%s] were not handed out by the stream; read back %d records",
                           verdict.start, verdict.end - 1, verdict.topic, verdict.partition, len(records) - 1)
        tails: list[Gap] = []
        if message.topic == control.get_topic_name() and CATCH_UP in (message.value or b""):
            # The timer saw this partition's inputs end past what the stream handed out: read the ends back.
            tails = continuity.behind(message.partition, highwater, now, 0.0, SESSION_INPUTS)
            try:
                read = [record for gap in tails for record in await range_reader.read(gap)]
            except TransportError as exc:
                logger.error("reading the ends of partition %s back failed: %s", message.partition, exc)
                continue
            if assignments[0] != generation:
                continue
            if read:
                logger.warning("partition %s: %d records on the log were not handed out by the stream; read "
                               "back", message.partition, len(read))
            records = [*read, *records]
        await aggregator.handle_batch(records)
        if assignments[0] != generation:
            # The partitions were reassigned while the record awaited a send: it is read again from the
            # committed offsets by its partition's owner; what it staged is dropped, never acknowledged.
            aggregator.reset(None)
            continue
        continuity.handled(message.topic, message.partition, message.offset)
        for gap in tails:
            continuity.read_to(gap)
            aggregator.read_back(gap.topic, gap.partition, gap.end)
        # Only now: the flush timer (which may run while the record awaits a send) acknowledges it.
        unflushed.append(event)
        if len(unflushed) >= conf.batch_records:
            await flush()


@app.timer(conf.batch_ms / 1000)
async def flush_timer() -> None:
    if not app.rebalancing:
        await flush()


@app.timer(conf.tick_s)
async def deadlines() -> None:
    """Ask the agent to build sessions that are due (ended and read up to, or past their deadline)."""
    if app.rebalancing or recovering[0] or not tables_recovered(app):
        aggregator.progress.active_since = None
        return
    actives = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == control.get_topic_name()}
    await aggregator.tick(actives)
    await _ask_catch_up(actives)


async def _ask_catch_up(actives: set[int]) -> None:
    """Ask the agent to read back the ends of partitions whose inputs are on the log but have not been
    handed out for a while (processors.trajectories.continuity: a hole at the end has no later record to reveal it)."""
    if not continuity.baselined:
        await _baseline()
    now = asyncio.get_running_loop().time()
    quiet_s = max(2.0, 4 * conf.settle_s)
    for partition in continuity.partitions_behind(highwater, now, quiet_s, SESSION_INPUTS) & actives:
        if now - catch_up_asked.get(partition, -quiet_s) >= quiet_s:
            catch_up_asked[partition] = now
            await send_control("", partition, {"kind": "catch_up", "session_id": ""})


@on_partitions(app.on_partitions_revoked)
async def _revoked(revoked: set[TP]) -> None:
    assignments[0] += 1
    await flush()  # still ours: write what was done and acknowledge it before the offsets are committed
    recovering[0] = True  # until the next assignment's tables are recovered, records are not handled


@on_partitions(app.on_partitions_assigned)
async def _assigned(assigned: set[TP]) -> None:
    assignments[0] += 1
    recovering[0] = True
    continuity.reset()
    catch_up_asked.clear()
    unflushed.clear()  # anything not flushed is read again from the committed offsets
    aggregator.reset({tp.partition for tp in assigned if tp.topic == control.get_topic_name()})


@on_signal(app.on_rebalance_complete)
async def _recovered() -> None:
    # The tables hold their changelogs now: whatever was read from them before (a scan that ran while
    # they were being read back) is read again.
    recovering[0] = False
    aggregator.forget_cached()


@on_signal(app.on_before_shutdown)
async def _stopping() -> None:
    # No flush here: Faust has left the group and closed the tables by now. What was acknowledged is on
    # the broker (see flush); the rest is read again by the partitions' next owner.
    await log_reader.stop()
    await range_reader.stop()
    await builds.close()  # builds still running are dropped: those sessions are built again later


@app.task
async def ask_ends() -> None:
    """Ask the broker where partitions end as soon as a waiting session needs it (the aggregator says
    which, see SessionAggregator.ask_wanted_ends), and have the agent look at them again: the last
    sessions of a burst, or of a quiet partition, are built within milliseconds, not at the next tick."""
    while True:
        await aggregator.ends_needed.wait()
        if app.rebalancing or recovering[0] or not tables_recovered(app):
            await asyncio.sleep(conf.tick_s)  # the wants stay; the assignment's reset clears them
            continue
        actives = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == control.get_topic_name()}
        try:
            for partition in sorted(await aggregator.ask_wanted_ends(actives)):
                await send_control("", partition, {"kind": "recheck", "session_id": ""})
        except Exception:  # never let this task die: the timer's tick asks too, but only every TICK_S
            logger.exception("asking where partitions end failed; asked again at the next want or tick")
            await asyncio.sleep(conf.tick_s)
        await asyncio.sleep(0.01)  # the wants of the next 10 ms go in one request


@app.task
async def start_builds() -> None:
    """Start the build processes with the worker (each imports the builders: about a second, usually
    over before the tables are recovered); a build that comes first waits for them."""
    if isinstance(builds, PooledBuilds):
        await builds.start()


@app.task
async def size_changelog_buffer() -> None:
    """Let Faust's producer buffer hold a whole flush of table writes. At its default (100 records) a
    flush of a few hundred sessions' writes made the stream stop at every record until the buffer was
    back under 100 ("producer buffer full"); :func:`flush` drains it anyway, every batch."""
    app.producer.buffer.max_messages = max(1000, 4 * conf.batch_records)


@app.task
async def health() -> None:
    """``GET /health`` on ROLLWIRE_PROCESSORS_HOST:PORT: 200 once tables are recovered, else 503."""
    await serve_health(app, conf.host, conf.port,
                       lambda: {**aggregator.counters, **continuity.counters,
                                                   "open_in_flight": len(aggregator.in_flight)})
