"""The gateway node: a member of the consumer group on ``sessions`` that runs the sessions it is handed.

Two or more nodes share the topic's partitions; when one dies, the group coordinator moves its partitions
to the others (after the group's session timeout). Delivery is at least once, and a session must not run
twice to completion, so:

- a partition's offset is committed only past sessions that ended (here, or found ended in
  ``session-events``) or that are not a node's to run (ad-hoc sessions, specs without an agent);
  undecodable records are dead-lettered by the EventConsumer;
- before a session runs, the node reads ``session-events`` up to its end and applies
  :func:`producers.gateway.ledger.decide`: an ended session is skipped; one another live node claimed is
  waited on; one a dead node claimed is run again if its harness had not started, and otherwise ended
  here as an infrastructure failure (``status=error, cause=node_lost``, the reason names the node);
- a node claims a session by sending its ``init`` event (acknowledged) while it still owns the partition;
  on revocation it lets its unclaimed sessions go and keeps running the claimed ones to their end.

Graceful drain (SIGTERM, :meth:`GatewayNode.drain`): unclaimed sessions are let go (their offsets stay
uncommitted, so the partition's next owner runs them), claimed ones run to their end, offsets are
committed, and the node leaves the group. A second request (:meth:`GatewayNode.stop_now`) cancels what
still runs. Cancelling one session: ``POST /v1/sessions/{id}/cancel`` on the node that holds it (the
``node`` of the session's latest stage event); it ends as ``cancelled`` with its patch so far.

Containers of a node that died hard are removed by the reaper (:mod:`producers.runtimes.reaper`): every
node runs a pass at start and every ``REAP_INTERVAL_S`` on this host's Docker engine, when the docker
SDK imports and an engine answers (a node never fails for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import httpx
from aiokafka import ConsumerRebalanceListener, TopicPartition

from producers.gateway.ledger import Decision, GroupMembers, SessionLedger, SessionRecord, decide, service_name
from producers.gateway.offsets import OffsetBook
from producers.gateway.pipeline import AdapterFor, Pipeline, RuntimeFor, SessionRun
from producers.gateway.settings import GatewaySettings
from producers.runtimes.base import Runtime
from producers.runtimes.reaper import reap_if_docker
from schemas.attribution import Cause, Evidence, kind_of
from schemas.sessions import SessionEnded, SessionSpec, SessionStage, SessionStageChanged, SessionStatus
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from schemas.transport.consumer import Received
from schemas.transport.errors import TransportError

logger = logging.getLogger(__name__)

_END_RETRY_S = 120.0
REAP_INTERVAL_S = 60.0


@dataclass
class _Waiting:
    """A session another live node claimed: its offsets stay open until its end shows up."""

    spec: SessionSpec
    partition: TopicPartition
    offsets: list[tuple[TopicPartition, int]] = field(default_factory=list)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, node: GatewayNode) -> None:
        self._node = node

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._node._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._node._assigned(set(assigned))


def _default_runtime_for() -> RuntimeFor:
    module = importlib.import_module("producers.runtimes")
    return module.runtime_for


def _default_adapter_for() -> AdapterFor:
    module = importlib.import_module("producers.adapters")
    return module.adapter_for


class GatewayNode:
    """One gateway node. ``await node.run()`` until :meth:`drain` (or :meth:`stop_now`) has finished."""

    def __init__(self, settings: GatewaySettings, kafka: KafkaSettings, *, runtime_for: RuntimeFor | None = None,
                 adapter_for: AdapterFor | None = None) -> None:
        self.settings = settings
        self.kafka = kafka
        self.name = settings.node_name
        self.group = settings.group(kafka.topic_prefix)
        self._runtime_factory = runtime_for or _default_runtime_for()
        self._adapter_for = adapter_for or _default_adapter_for()
        self._runtimes: dict[str, Runtime] = {}
        self._sessions: dict[str, SessionRun] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._offsets = OffsetBook()
        self._claim_lock = asyncio.Lock()
        self._draining = asyncio.Event()
        self._stopping = False
        self.started = asyncio.Event()
        self.ended: Counter[str] = Counter()
        """Sessions ended by this node, by status (orphans it ended included)."""
        self._producer: EventProducer | None = None
        self._consumer: EventConsumer | None = None
        self._ledger: SessionLedger | None = None
        self._members: GroupMembers | None = None
        self._pipeline: Pipeline | None = None

    # -- public -----------------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def drain(self) -> None:
        """Take no new sessions, finish the claimed ones, commit, leave the group (``run`` then returns)."""
        if self._draining.is_set():
            self.stop_now()
            return
        logger.info("gateway node %s: draining (%d sessions held)", self.name, len(self._sessions))
        self._draining.set()

    def stop_now(self) -> None:
        """Drain, and cancel the sessions that still run (they end as cancelled, with their patch)."""
        self._draining.set()
        self._stopping = True
        for session in list(self._sessions.values()):
            session.cancel(f"gateway node {self.name} stopped")

    def cancel(self, session_id: str, reason: str) -> SessionRun | None:
        """Cancel a session this node holds; None if it holds none by that id."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.cancel(reason)
        return session

    def held(self) -> list[SessionRun]:
        return list(self._sessions.values())

    def waiting(self) -> int:
        return len(self._waiting)

    def partitions(self) -> int:
        """How many `sessions` partitions this node holds (0 until it has joined the group)."""
        return len(self._offsets)

    async def run(self) -> None:
        """Join the group and run sessions until drained."""
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx.AsyncClient())
            self._producer = await stack.enter_async_context(
                EventProducer(self.kafka, service=f"gateway.{self.name}"))
            self._ledger = SessionLedger(self.kafka, service=f"gateway-ledger.{self.name}")
            await self._ledger.start()
            stack.push_async_callback(self._ledger.stop)
            self._members = GroupMembers(self.kafka, self.group)
            stack.push_async_callback(self._members.close)
            self._pipeline = Pipeline(self.settings, emit=self._emit, claim=self._claim,
                                      runtime_for=self._runtime_for, adapter_for=self._adapter_for, http=http)
            self._consumer = EventConsumer(self.kafka, [Topic.SESSIONS], group_id=self.group,
                                           service=service_name(self.name), dedupe_window=0,
                                           listener=_Rebalance(self))
            await stack.enter_async_context(self._consumer)
            reaper = asyncio.create_task(self._reap_forever(), name=f"gateway-reaper-{self.name}")
            stack.push_async_callback(_stop, reaper)
            self.started.set()
            logger.info("gateway node %s in group %s (run slots %d, prewarm %d, init workers %d)", self.name,
                        self.group, self.settings.run_slots, self.settings.prewarm, self.settings.init_workers)
            await self._consume()
            await self._finish()
        logger.info("gateway node %s left the group", self.name)

    async def _reap_forever(self) -> None:
        """Remove orphaned session containers of this host now and every ``REAP_INTERVAL_S``."""
        while True:
            try:
                removed = await asyncio.to_thread(reap_if_docker)
            except Exception:  # never the node's failure
                logger.warning("gateway node %s: reaper pass failed", self.name, exc_info=True)
            else:
                if removed:
                    logger.info("gateway node %s: reaper removed %d orphaned container(s): %s", self.name,
                                len(removed), ", ".join(removed))
            await asyncio.sleep(REAP_INTERVAL_S)

    # -- the loop ---------------------------------------------------------------------------------------
    async def _consume(self) -> None:
        assert self._consumer is not None
        loop = asyncio.get_running_loop()
        next_recheck = loop.time() + self.settings.recheck_s
        while not self._draining.is_set():
            try:
                batch = await self._consumer.getmany(timeout_ms=200)
                if batch:
                    await self._take(batch)
                await self._read_up_to()
                if self._waiting and loop.time() >= next_recheck:
                    next_recheck = loop.time() + self.settings.recheck_s
                    await self._recheck()
                await self._commit()
            except TransportError as exc:
                logger.warning("gateway node %s: %s; retrying", self.name, exc)
                await asyncio.sleep(1)

    async def _finish(self) -> None:
        """The drain: let unclaimed sessions go, wait for the claimed ones, keep the membership alive."""
        assert self._consumer is not None
        async with self._claim_lock:
            for session in list(self._sessions.values()):
                session.release()
            self._waiting.clear()  # their offsets stay open: the partition's next owner decides again
        while self._sessions:
            try:
                for received in await self._consumer.getmany(timeout_ms=200):
                    # Taken by no one here: open offsets keep the commit before them.
                    self._offsets.received(TopicPartition(received.topic, received.partition), received.offset)
                await self._read_up_to()
                await self._commit()
            except TransportError as exc:
                logger.warning("gateway node %s: %s while draining", self.name, exc)
                await asyncio.sleep(1)
        with contextlib.suppress(TransportError):
            await self._commit()

    async def _take(self, batch: list[Received]) -> None:
        fresh: list[tuple[SessionSpec, TopicPartition, int]] = []
        for received in batch:
            tp = TopicPartition(received.topic, received.partition)
            self._offsets.received(tp, received.offset)
            spec = received.event
            if not isinstance(spec, SessionSpec) or spec.origin != "rollout" or spec.agent is None:
                self._offsets.finish(tp, received.offset)  # not a gateway node's to run
            else:
                fresh.append((spec, tp, received.offset))
        if not fresh:
            return
        assert self._ledger is not None
        await self._ledger.sync()
        live: frozenset[str] | None = None
        for spec, tp, offset in fresh:
            if (running := self._sessions.get(spec.session_id)) is not None:
                running.offsets.append((tp, offset))  # a redelivery of a session this node runs
                continue
            if (waiting := self._waiting.get(spec.session_id)) is not None:
                waiting.offsets.append((tp, offset))
                continue
            record = self._ledger.get(spec.session_id)
            decision = decide(record, node=self.name, live_nodes=live)
            if decision is Decision.WAIT and live is None:
                live = await self._live_nodes()
                decision = decide(record, node=self.name, live_nodes=live)
            await self._apply(decision, record, spec, tp, [(tp, offset)])

    async def _live_nodes(self) -> frozenset[str] | None:
        assert self._members is not None
        try:
            return await self._members.live_nodes()
        except TransportError as exc:
            logger.warning("gateway node %s: cannot list the group's members (%s); waiting", self.name, exc)
            return None

    async def _apply(self, decision: Decision, record: SessionRecord | None, spec: SessionSpec,
                     tp: TopicPartition, offsets: list[tuple[TopicPartition, int]]) -> None:
        if decision is Decision.SKIP:
            self._finish_offsets(offsets)
        elif decision is Decision.WAIT:
            self._waiting[spec.session_id] = _Waiting(spec, tp, offsets)
        elif decision is Decision.END_ORPHANED:
            assert record is not None and record.stage is not None
            stage = record.stage.value
            reason = f"gateway node {record.node} stopped while the session was in {stage}; ended by {self.name}"
            ended = SessionEnded(session_id=spec.session_id, task_id=spec.task_id, status=SessionStatus.ERROR,
                                 failure=kind_of(Cause.NODE_LOST), cause=Cause.NODE_LOST, reason=reason,
                                 evidence=Evidence(stage=stage, detail=reason))
            logger.warning("session %s: %s", spec.session_id, ended.reason)
            await self._send_end(ended)
            self._finish_offsets(offsets)
        else:
            self._start(spec, tp, offsets)

    def _start(self, spec: SessionSpec, tp: TopicPartition, offsets: list[tuple[TopicPartition, int]]) -> None:
        session = SessionRun(spec=spec, partition=tp, offsets=offsets)
        self._sessions[spec.session_id] = session
        session.task = asyncio.create_task(self._session(session), name=f"gateway-{spec.session_id}")

    async def _session(self, session: SessionRun) -> SessionEnded | None:
        assert self._pipeline is not None
        ended: SessionEnded | None = None
        try:
            queued = self._pipeline.stage_event(session, SessionStage.QUEUED)
            self._pipeline.entered(session, queued)
            await self._emit(queued, False)
            ended = await self._pipeline.run(session)
            if ended is not None:
                await self._send_end(ended)
                self._finish_offsets(session.offsets)
            return ended
        except Exception:
            logger.exception("session %s: the node could not finish it; its offset stays uncommitted",
                             session.session_id)
            return None
        finally:
            self._sessions.pop(session.session_id, None)

    async def _recheck(self) -> None:
        """Look again at sessions other nodes claimed: ended, or their node gone."""
        assert self._ledger is not None
        await self._ledger.sync()
        live = await self._live_nodes()
        for session_id, waiting in list(self._waiting.items()):
            record = self._ledger.get(session_id)
            decision = decide(record, node=self.name, live_nodes=live)
            if decision is not Decision.WAIT:
                del self._waiting[session_id]
                await self._apply(decision, record, waiting.spec, waiting.partition, waiting.offsets)

    # -- claims, events, offsets ------------------------------------------------------------------------
    async def _claim(self, session: SessionRun, event: SessionStageChanged) -> bool:
        """Send the session's ``init`` event while this node owns its partition (see the module docstring)."""
        assert self._pipeline is not None
        while True:
            async with self._claim_lock:
                if session.released or self._draining.is_set() or not self._offsets.owns(session.partition):
                    return False
                try:
                    await self._emit(event, True)
                except TransportError as exc:
                    logger.warning("session %s: cannot claim it (%s); retrying", session.session_id, exc)
                else:
                    session.claimed = True
                    self._pipeline.entered(session, event)
                    return True
            await asyncio.sleep(1)

    async def _emit(self, event: SessionStageChanged, required: bool) -> None:
        assert self._producer is not None
        try:
            await self._producer.send(event)
        except TransportError:
            if required:
                raise
            logger.warning("session %s: stage %s not recorded", event.session_id, event.stage.value,
                           exc_info=True)

    async def _send_end(self, ended: SessionEnded) -> None:
        """Send a session's end, retrying while Kafka refuses it (its offset is committed only after)."""
        assert self._producer is not None
        delay, waited = 0.5, 0.0
        while True:
            try:
                await self._producer.send(ended)
                self.ended[ended.status.value] += 1
                return
            except TransportError:
                if waited >= _END_RETRY_S:
                    raise
                logger.warning("session %s: end not recorded yet; retrying", ended.session_id, exc_info=True)
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 10.0)

    async def _read_up_to(self) -> None:
        """Move each partition's read position past records the consumer dead-lettered (they never reach
        this node), so that the commit does not stop before them."""
        assert self._consumer is not None
        for tp, position in (await self._consumer.positions()).items():
            self._offsets.read_up_to(tp, position)

    def _finish_offsets(self, offsets: list[tuple[TopicPartition, int]]) -> None:
        for tp, offset in offsets:
            self._offsets.finish(tp, offset)

    async def _commit(self, partitions: set[TopicPartition] | None = None) -> None:
        assert self._consumer is not None
        offsets = self._offsets.to_commit(partitions)
        if offsets:
            await self._consumer.commit(offsets)
            self._offsets.committed(offsets)

    def _runtime_for(self, kind: str) -> Runtime:
        if kind not in self._runtimes:
            runtime = self._runtime_factory(kind)
            if runtime.node is None:
                runtime.node = self.name  # containers say which node made them
            self._runtimes[kind] = runtime
        return self._runtimes[kind]

    # -- rebalance --------------------------------------------------------------------------------------
    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        try:
            await self._commit(revoked)
        except TransportError as exc:
            logger.warning("gateway node %s: commit on revocation failed (%s)", self.name, exc)
        async with self._claim_lock:
            self._offsets.revoke(revoked)
            for session in list(self._sessions.values()):
                if session.partition in revoked:
                    session.release()  # claimed ones keep running; their end shows on session-events
            for session_id, waiting in list(self._waiting.items()):
                if waiting.partition in revoked:
                    del self._waiting[session_id]
        if revoked:
            logger.info("gateway node %s: partitions revoked: %s", self.name, sorted(p.partition for p in revoked))

    def _assigned(self, assigned: set[TopicPartition]) -> None:
        self._offsets.assign(assigned)
        if assigned:
            logger.info("gateway node %s: partitions assigned: %s", self.name,
                        sorted(p.partition for p in assigned))


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def stages_held(sessions: list[SessionRun]) -> dict[str, int]:
    """Sessions per stage."""
    return dict(Counter(session.stage.value for session in sessions))

