"""The trajectory worker, a Faust app: completions + session events in, one Trajectory per session out.

Top to bottom: settings, the app, topics, tables, the agent, the timer, the health page. The logic is
in processors/aggregate.py (records → tables → builds); this module only wires it to Faust. Run it with
``rollwire processors`` (which creates the topics first). Configuration: ``ROLLWIRE_*`` (Kafka, see
schemas.transport.KafkaSettings) and ``ROLLWIRE_PROCESSORS_*`` (see processors.settings).

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

from processors.aggregate import Outputs, SessionAggregator, Tables
from processors.faust_worker import RAW, app_settings, on_partitions, on_signal, send_event, tables_recovered
from processors.health import serve_health
from processors.payloads import LogReader
from processors.settings import ProcessorSettings
from processors.topics import app_id, changelog_configs, control_topic
from schemas.dead_letter import DeadLetter
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport.settings import KafkaSettings

logger = logging.getLogger(__name__)

kafka = KafkaSettings()
conf = ProcessorSettings()
registry = kafka.registry()
SOURCE = f"processors@{socket.gethostname()}:{os.getpid()}"
PARTITIONS = kafka.session_partitions

app = faust.App(
    app_id(kafka, conf.app_id),
    **app_settings(kafka, store=conf.store, data_dir=conf.data_dir, partitions=PARTITIONS,
                   session_timeout_s=conf.session_timeout_s),
    producer_compression_type=None if conf.compression == "none" else conf.compression,
    producer_linger=0.005,  # batch the changelog writes: one produce request per record costs more CPU
    producer_max_batch_size=1024 * 1024,  # aiokafka's 16 kB default put every trajectory in its own batch
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


tables = Tables(
    open=_table("open_sessions", "session id -> OpenSession (small)"),
    specs=_table("session_specs", "session id -> SpecFacts"),
    built=_table("built_sessions", "session id -> trajectory event id"),
)


async def send_trajectory(trajectory: Trajectory, partition: int) -> None:
    future = await send_event(trajectories, trajectory, SOURCE, partition)

    def done(fut: asyncio.Future[RecordMetadata]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            logger.error("trajectory %s of %s not recorded: %r", trajectory.event_id, trajectory.session_id,
                         None if fut.cancelled() else fut.exception())
            aggregator.on_send_failed(trajectory.session_id)
            return
        asyncio.ensure_future(send_control(trajectory.session_id, partition, aggregator.emitted_record(trajectory)))

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


aggregator = SessionAggregator(
    tables, Outputs(send_trajectory, send_dead_letter, send_control, highwater, log_reader.read), registry,
    control_topic=control_topic(kafka, conf.app_id), group=app.conf.id, idle_s=conf.idle_s,
    grace_s=conf.grace_s, settle_s=conf.settle_s, max_message_bytes=kafka.max_message_bytes,
    cache_bytes=conf.cache_mb * 1024 * 1024)


# Records handled whose effect on the tables is still only in memory: acknowledged after the next flush.
unflushed: list[faust.EventT] = []


def flush() -> None:
    """Write the buffered table changes, then acknowledge the records they came from.

    A table write finds its partition (RocksDB store, changelog partition) through the current event:
    for each partition one of its unflushed records is made current while its writes are applied. Every
    record on partition P of an input (and every control record sent there) concerns sessions of
    partition P, so that is where their state belongs.
    """
    if not unflushed:
        return
    latest = {event.message.partition: event for event in unflushed}

    def enter(partition: int) -> bool:
        event = latest.get(partition)
        if event is None:
            return False
        _current_event.set(weakref.ref(event))
        return True

    try:
        aggregator.flush(enter)
    finally:
        _current_event.set(None)
    for event in unflushed:
        event.ack()
    unflushed.clear()


@app.agent(inputs, concurrency=1)
async def sessions(stream: faust.StreamT) -> None:
    """Every input record, in partition order, one at a time (the single writer of the tables).

    Acknowledgements are manual: a record is acknowledged (and its offset may be committed) only after
    the table writes it caused are flushed, every ``batch_records`` records or ``batch_ms``, whichever
    comes first. A session's state is written once per flush however many of its records came in.
    """
    assert isinstance(stream, faust.Stream)  # declared as StreamT, which has no noack()
    async for event in stream.noack().events():
        unflushed.append(event)
        if conf.transport_only:  # benchmarks: what Faust and the broker cost with no work done
            aggregator.counters["records"] += 1
            continue
        await aggregator.handle_batch((event.message,))
        if len(unflushed) >= conf.batch_records:
            flush()


@app.timer(conf.batch_ms / 1000)
async def flush_timer() -> None:
    if not app.rebalancing:
        flush()


@app.timer(conf.tick_s)
async def deadlines() -> None:
    """Ask the agent to build sessions that are due (ended and read up to, or past their deadline)."""
    if app.rebalancing or not tables_recovered(app):
        aggregator.progress.active_since = None
        return
    actives = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == control.get_topic_name()}
    await aggregator.tick(actives)


@on_partitions(app.on_partitions_revoked)
async def _revoked(revoked: set[TP]) -> None:
    flush()  # still ours: write what was done and acknowledge it before the offsets are committed


@on_partitions(app.on_partitions_assigned)
async def _assigned(assigned: set[TP]) -> None:
    unflushed.clear()  # anything not flushed is read again from the committed offsets
    aggregator.reset({tp.partition for tp in assigned if tp.topic == control.get_topic_name()})


@on_signal(app.on_before_shutdown)
async def _stopping() -> None:
    flush()  # a clean stop leaves nothing to redo
    await log_reader.stop()


@app.task
async def health() -> None:
    """``GET /health`` on ROLLWIRE_PROCESSORS_HOST:PORT: 200 once tables are recovered, else 503."""
    await serve_health(app, conf.host, conf.port,
                       lambda: {**aggregator.counters, "open_in_flight": len(aggregator.in_flight)})
