"""The evaluator consumer: session ends in, evaluations out, in the evaluator's own consumer group.

Each evaluator runs as its own consumer group (``<topic prefix>evaluator-<name>``) on ``session-events``,
off the rollout's critical path; several evaluators score the same session independently. For every
``session.ended`` the runner looks up the session's spec, decides whether this evaluator scores it, runs
:meth:`~processors.evaluators.base.Evaluator.evaluate` (several at once, up to ``concurrency``) and writes
the Evaluation to ``evaluations``. Offsets are committed only after the broker has every evaluation of
the batch (at least once; a re-scored session gets the same event id, see base.py).

Which sessions: by default those whose spec names this evaluator (``spec.evaluator.name``), with the
spec's settings; with ``select_all`` every ended session, with the spec's settings when it names this
evaluator and the runner's default settings otherwise (a session without a spec included).

Specs come from the compacted ``sessions`` topic, read whole by a :class:`SpecRegistry` (an EventConsumer
without a group: every runner sees every partition, as the proxy's registry does). Only the specs this evaluator
may score are kept, so its memory is the relevant sessions' specs. A session end whose spec has not been
read yet waits until the registry has read up to the ``sessions`` topic's end as it was at that moment:
specs are written before their sessions start, so the spec is then known or does not exist.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Iterable

from aiokafka import TopicPartition

from processors.evaluators.base import Evaluator
from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings, TransportError

logger = logging.getLogger(__name__)

SPEC_WAIT_S = 30.0


def consumer_group(kafka: KafkaSettings, evaluator: str) -> str:
    """The evaluator's consumer group: the deployment's topic prefix, ``evaluator-``, the name."""
    return f"{kafka.topic_prefix}evaluator-{evaluator}"


class SpecRegistry:
    """Session specs read from the compacted ``sessions`` topic, for the sessions one evaluator may score."""

    def __init__(self, kafka: KafkaSettings, evaluator: str, *, keep_all: bool) -> None:
        self.kafka, self.evaluator, self.keep_all = kafka, evaluator, keep_all
        self.topic = kafka.registry().name(Topic.SESSIONS)
        # Decode failures are skipped with a warning: the spec's own consumers dead-letter them.
        self._consumer = EventConsumer(kafka, [Topic.SESSIONS], group_id=None, service=f"evaluator-{evaluator}-specs",
                                       dead_letters=False)
        self._specs: dict[str, SessionSpec] = {}
        self._others: set[str] = set()  # specs seen that name another evaluator (ids only)
        self._partitions: list[TopicPartition] = []
        self._reader: asyncio.Task[None] | None = None
        self._progress = asyncio.Condition()

    async def start(self) -> None:
        """Start reading: every partition of ``sessions`` from the beginning (assigned before this returns,
        so that :meth:`get` knows which ends to read up to)."""
        await self._consumer.start()
        try:
            self._partitions = await self._consumer.wait_for_assignment()
            await self._consumer.seek_to_beginning(self._partitions)
        except TransportError:
            await self._consumer.stop()
            raise
        self._reader = asyncio.create_task(self._read(), name=f"specs-{self.evaluator}")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        await self._consumer.stop()

    def _relevant(self, spec: SessionSpec) -> bool:
        return self.keep_all or (spec.evaluator is not None and spec.evaluator.name == self.evaluator)

    async def _read(self) -> None:
        while True:
            for received in await self._consumer.getmany(timeout_ms=500):
                spec = received.event
                assert isinstance(spec, SessionSpec)  # the only event type the sessions topic carries
                if self._relevant(spec):
                    self._specs[spec.session_id] = spec
                    self._others.discard(spec.session_id)
                else:
                    self._specs.pop(spec.session_id, None)
                    self._others.add(spec.session_id)
            async with self._progress:
                self._progress.notify_all()

    async def get(self, session_id: str, wait_s: float = SPEC_WAIT_S) -> SessionSpec | None:
        """The session's spec if this evaluator may score it; None if its spec names another evaluator, or
        (after reading up to the topic's current end, at most ``wait_s``) no spec exists."""
        if session_id in self._specs or session_id in self._others:
            return self._specs.get(session_id)
        ends = await self._consumer.end_offsets(self._partitions)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        async with self._progress:
            while not await self._consumer.caught_up(ends) and loop.time() < deadline:
                if self._reader is not None and self._reader.done():
                    self._reader.result()  # the reader died: raise its error
                try:
                    await asyncio.wait_for(self._progress.wait(), max(0.01, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
        return self._specs.get(session_id)


class EvaluatorRunner:
    """One evaluator as a consumer: ``await runner.run(stop)`` until ``stop`` is set."""

    def __init__(self, kafka: KafkaSettings, evaluator: Evaluator, *, select_all: bool = False,
                 concurrency: int = 4, group_id: str | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.kafka, self.evaluator, self.select_all = kafka, evaluator, select_all
        self.concurrency = concurrency
        self.group_id = group_id or consumer_group(kafka, evaluator.name)
        self.counters: dict[str, int] = {"evaluated": 0, "errors": 0, "skipped": 0}

    def selects(self, spec: SessionSpec | None) -> bool:
        """Whether this evaluator scores the session (see the module docstring)."""
        if self.select_all:
            return True
        return spec is not None and spec.evaluator is not None and spec.evaluator.name == self.evaluator.name

    async def score(self, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation:
        """The evaluator's verdict; an unexpected exception becomes an evaluation with status 'error'."""
        try:
            evaluation = await self.evaluator.evaluate(ended, spec)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any evaluator bug is reported on the topic, not fatal
            logger.exception("evaluator %s failed on session %s", self.evaluator.name, ended.session_id)
            tail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            evaluation = self.evaluator.failed(ended, spec, f"evaluator raised {tail}")
        self.counters["errors" if evaluation.status == "error" else "evaluated"] += 1
        return evaluation

    async def _score_batch(self, ends: Iterable[SessionEnded], registry: SpecRegistry) -> list[Evaluation]:
        semaphore = asyncio.Semaphore(self.concurrency)

        async def one(ended: SessionEnded) -> Evaluation | None:
            spec = await registry.get(ended.session_id)
            if not self.selects(spec):
                self.counters["skipped"] += 1
                return None
            async with semaphore:
                return await self.score(ended, spec)

        results = await asyncio.gather(*(one(ended) for ended in ends))
        return [evaluation for evaluation in results if evaluation is not None]

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume until ``stop`` is set (or forever)."""
        stop = stop or asyncio.Event()
        service = f"evaluator-{self.evaluator.name}"
        registry = SpecRegistry(self.kafka, self.evaluator.name, keep_all=self.select_all)
        await registry.start()
        try:
            async with EventProducer(self.kafka, service=service) as producer, \
                    EventConsumer(self.kafka, [Topic.SESSION_EVENTS], group_id=self.group_id,
                                  service=service) as consumer:
                logger.info("evaluator %s@%s consuming as group %s", self.evaluator.name, self.evaluator.version,
                            self.group_id)
                while not stop.is_set():
                    received = await consumer.getmany(timeout_ms=500, max_records=self.concurrency * 8)
                    ends = [r.event for r in received if isinstance(r.event, SessionEnded)]
                    if ends:
                        evaluations = await self._score_batch(ends, registry)
                        if evaluations:
                            await producer.send_many(evaluations)
                    if received:
                        await consumer.commit()
        finally:
            await registry.stop()
