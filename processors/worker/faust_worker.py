"""What rollwire's Faust workers (trajectories, groups) share: the app settings, typed access to the parts
of Faust its type declarations leave loose (signals, table recovery, sends), and how a worker starts.

Both are at-least-once consumer groups over external topics with RocksDB (or memory) tables, no
aiohttp web server and no leader topic; both keep their state under the Kafka cluster's id
(processors/worker/state.py) and run without Faust's terminal spinner.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from pathlib import Path
from typing import Any, TypedDict

import faust
from faust.tables.manager import TableManager
from faust.sensors.monitor import Monitor
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, CollectionT, EventT, Message, PendingMessage, ProducerT, RecordMetadata, StreamT
from mode.services import WaitArgT, WaitResults
from mode.utils.times import Seconds
from mode.types.signals import BaseSignalT

from processors.worker.settings import FaustWorkerSettings
from processors.worker.state import cluster_state_dir_now
from schemas.codec import encode_record
from schemas.envelope import Event
from schemas.transport.settings import KafkaSettings


class Codecs(TypedDict):
    """The serializer arguments of a Faust topic, table or schema."""

    key_serializer: str
    value_serializer: str


# Raw bytes in and out: our codecs (schemas.codec) decode and validate, Faust only moves records.
RAW: Codecs = {"key_serializer": "raw", "value_serializer": "raw"}


class QuietMonitor(Monitor):
    """Faust's monitor without its bookkeeping per record, per table access and per send.

    Faust's default monitor counts and times every record in and out, every table get and set and every
    send, for its web views and its statistics, which these workers have neither of (their health pages
    report their own counters). Those calls ran on the event loop for each record (``bench.pipeline``
    measures the worker's CPU per record). What Faust's consumer itself asks of the monitor (committed
    and end offsets) is kept."""

    def on_message_in(self, tp: TP, offset: int, message: Message) -> None:
        pass

    def on_stream_event_in(self, tp: TP, offset: int, stream: StreamT, event: EventT) -> dict | None:
        return None

    def on_stream_event_out(self, tp: TP, offset: int, stream: StreamT, event: EventT,
                            state: dict | None = None) -> None:
        pass

    def on_message_out(self, tp: TP, offset: int, message: Message) -> None:
        pass

    def on_table_get(self, table: CollectionT, key: Any) -> None:
        pass

    def on_table_set(self, table: CollectionT, key: Any, value: Any) -> None:
        pass

    def on_table_del(self, table: CollectionT, key: Any) -> None:
        pass

    def on_send_initiated(self, producer: ProducerT, topic: str, message: PendingMessage, keysize: int,
                          valsize: int) -> Any:
        return None

    def on_send_completed(self, producer: ProducerT, state: Any, metadata: RecordMetadata) -> None:
        pass


_EVENT_WAIT = asyncio.Event.wait.__code__


async def _continued(coroutine: Coroutine[Any, Any, Any], waiting_on: Any) -> Any:
    """Go on running ``coroutine``, already started and now suspended on ``waiting_on`` (see _Resumed)."""
    return await _Resumed(coroutine, waiting_on)


class _Resumed:
    """Awaiting it goes on running ``coroutine`` (started elsewhere, now suspended on ``waiting_on``: what
    its innermost await handed up) as its own task would: ``waiting_on`` goes up to the task that awaits
    this, and what that task sends or throws back (a wake-up, a cancellation) goes down into
    ``coroutine``, until it returns."""

    __slots__ = ("coroutine", "waiting_on")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self.coroutine, self.waiting_on = coroutine, waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, waiting_on = self.coroutine, self.waiting_on
        while True:
            try:
                sent = yield waiting_on
            except BaseException as exc:  # thrown in by the task (CancelledError included): pass it on
                try:
                    waiting_on = coroutine.throw(exc)
                except StopIteration as done:
                    return done.value
                continue
            try:
                waiting_on = coroutine.send(sent)
            except StopIteration as done:
                return done.value


class EagerConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer, handing a fetched record to the streams without four tasks per record.

    Faust's fetch loop hands each record to the conductor as ``wait_first(callback(record),
    suspend_flow.wait())``: the hand-over may wait (a stream's buffer is full), and a rebalance
    (``suspend_flow``) or a stop must cut that wait short. ``Service.wait_first`` runs every argument
    as a task of its own, adds tasks waiting for the service's stop and crash, waits for the first to
    finish and cancels the other three: four tasks created, three cancelled, for every record, although
    the hand-over finishes at once unless a buffer is full. Here the hand-over is run in place first;
    only if it has to wait does it go on as a task, raced against the rest exactly as Faust does, so
    the semantics are Faust's, without the tasks created and cancelled per record (``bench.pipeline``'s
    flood measures the worker's time per record)."""

    # mode declares ``timeout: Seconds = None`` (its default is None, its type says Seconds).
    async def wait_first(self, *coros: WaitArgT, timeout: Seconds = None) -> WaitResults:  # type: ignore[assignment]
        if len(coros) != 2 or timeout is not None:
            return await super().wait_first(*coros, timeout=timeout)
        handing, flow = coros
        # Only the fetch loop's call (a coroutine not started yet, and ``suspend_flow.wait()``), and only
        # while the flow runs and the service is not stopping; anything else is Faust's race as it is.
        if not (isinstance(handing, types.CoroutineType) and isinstance(flow, types.CoroutineType)
                and flow.cr_code is _EVENT_WAIT and inspect.getcoroutinestate(handing) == inspect.CORO_CREATED
                and not self.suspend_flow.is_set() and not self.should_stop):
            return await super().wait_first(*coros, timeout=timeout)
        try:
            waiting_on = handing.send(None)
        except StopIteration as done:
            flow.close()  # never started: closed without a "never awaited" warning
            return WaitResults([handing], [done.value], False)
        except BaseException:
            flow.close()
            raise
        return await super().wait_first(_continued(handing, waiting_on), flow)


class EagerTransport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with :class:`EagerConsumer`."""

    Consumer = EagerConsumer


def worker_app(app_id: str, **settings: Any) -> faust.App:
    """A ``faust.App`` whose consumer is :class:`EagerConsumer` (set before anything asks for the
    transport: declaring a topic does)."""
    app = faust.App(app_id, **settings)
    app.transport = EagerTransport(app.conf.broker_consumer, app)
    return app


def app_settings(kafka: KafkaSettings, *, store: str, data_dir: Path, partitions: int,
                 session_timeout_s: float) -> dict[str, Any]:
    """Keyword arguments of ``faust.App`` common to rollwire's workers (each adds its own).

    ``data_dir`` is the worker's setting; the tables go under its folder for this Kafka cluster, asked of
    the broker here (processors.worker.state)."""
    state_dir = cluster_state_dir_now(data_dir, kafka.kafka_bootstrap)
    return {
        "broker": [f"kafka://{server.strip()}" for server in kafka.kafka_bootstrap.split(",")],
        "store": "rocksdb://" if store == "rocksdb" else "memory://",
        # One folder per app id (the topic prefix and the worker's name) under the cluster's: a table's
        # RocksDB files are a copy of that app's changelogs only. Shared by two prefixes on one cluster,
        # the second worker found the first one's persisted offsets beyond its own (empty) changelogs and
        # stopped with Faust's ConsistencyError. Faust fills in ``{conf.id}``.
        "datadir": str(state_dir / "{conf.id}"),
        "topic_partitions": partitions,
        "topic_replication_factor": kafka.replication_factor,  # the changelogs: as the deployment's topics
        "topic_disable_leader": True,  # no extra "__leader" topic: nothing here needs a leader
        "web_enabled": False,  # the health page (processors/worker/health.py) needs no aiohttp
        "processing_guarantee": "at_least_once",  # Faust's exactly-once mode is deliberately not used
        "producer_acks": -1,
        "producer_max_request_size": kafka.max_message_bytes,
        "consumer_max_fetch_size": kafka.fetch_bytes,
        "consumer_auto_offset_reset": "earliest",
        "broker_commit_interval": 1.0,
        "broker_session_timeout": session_timeout_s,
        "broker_heartbeat_interval": min(3.0, session_timeout_s / 3),
        "table_standby_replicas": 0,
        # Faust's repaired Cython fast paths (off by default in 0.15): the stream iterator takes a record
        # already waiting in the channel's queue without awaiting the channel.
        "cython_optimizations": True,
        "monitor": QuietMonitor(),
    }


def run_worker(app_module: str, conf: FaustWorkerSettings) -> None:
    """Run the Faust app of ``app_module`` (its module attribute ``app``) in the foreground.

    The app module reads its own settings (``conf``'s class) when it is imported, here, after the event
    loop is chosen; ``conf`` says which loop and the log level. ``uvloop`` is libuv's loop (Faust's
    consumer thread gets one too), ``asyncio`` the standard library's: a worker's loop runs a handful of
    callbacks, futures and socket or pipe events per record, and that process (its loop and Faust's
    consumer thread share the GIL) is what bounds a flooded worker; ``bench.pipeline --asyncio-loop-too``
    measures the two.
    """
    from faust.worker import Worker

    if conf.event_loop == "uvloop":
        import uvloop

        # Set before the worker asks for its loop (mode's Worker takes the policy's loop of this thread).
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    app = importlib.import_module(app_module).app
    worker = Worker(app, loglevel=conf.log_level)
    # Faust's terminal spinner (kept at WARNING and above) sets the root logger to DEBUG so that every
    # debug line of aiokafka and Faust makes a LogRecord, on the worker's CPU, for nothing. Not wanted.
    worker.spinner = None
    worker.execute_from_commandline()


async def send_event(topic: faust.TopicT, event: Event, source: str,
                     partition: int | None = None) -> asyncio.Future[RecordMetadata]:
    """Stamp and encode ``event`` (schemas.codec.encode_record) and hand it to the producer; returns the
    future the broker's acknowledgement resolves, without waiting for it."""
    record = encode_record(event, source)
    future = await topic.send(key=record.key, value=record.value, headers=record.headers, partition=partition)
    # Declared as a bare Awaitable; a topic's send returns the producer's asyncio future.
    assert isinstance(future, asyncio.Future)
    return future


def tables_recovered(app: faust.App) -> bool:
    """Whether the app's tables are recovered (their changelogs read back since the last assignment)."""
    manager = app.tables
    # The declared TableManagerT has no ``recovery``; the table manager Faust uses (TableManager) has.
    assert isinstance(manager, TableManager)
    return manager.recovery.completed.is_set()


PartitionsHandler = Callable[[set[TP]], Awaitable[None]]
Handler = Callable[[], Awaitable[None]]


def on_partitions(app_signal: BaseSignalT[Any]) -> Callable[[PartitionsHandler], PartitionsHandler]:
    """Decorator: run ``handler(partitions)`` on ``app.on_partitions_assigned`` or ``app.on_partitions_revoked``.

    Faust calls a signal's receivers as ``receiver(app, partitions, signal=...)``, while mode declares a
    receiver as ``(sender, /, *args, signal, **kwargs)``: the receiver connected here has that declared
    shape and hands the handler the partitions."""

    def connect(handler: PartitionsHandler) -> PartitionsHandler:
        async def receiver(sender: Any, /, *args: Any, signal: BaseSignalT[Any], **kwargs: Any) -> None:
            (partitions,) = args
            await handler(partitions)

        app_signal.connect(receiver)  # a strong reference (mode's default): the receiver lives as long as the app
        return handler

    return connect


def on_signal(app_signal: BaseSignalT[Any]) -> Callable[[Handler], Handler]:
    """Decorator: run ``handler()`` on a signal that carries no arguments (``app.on_before_shutdown``)."""

    def connect(handler: Handler) -> Handler:
        async def receiver(sender: Any, /, *args: Any, signal: BaseSignalT[Any], **kwargs: Any) -> None:
            await handler()

        app_signal.connect(receiver)
        return handler

    return connect
