"""Gateway nodes for the tests: in this process (``running_node``) or as ``python -m producers.gateway.cli``
subprocesses (``start_node``, ``stop``), the session specs published to them, and the sessions' lifecycle
read back from ``session-events`` (``Lifecycle``), with the stages every session goes through in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings
from producers.runtimes.local import LocalRuntime
from schemas.sessions import SessionEnded, SessionSpec, SessionStage, SessionStageChanged
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from tests.proxy.conftest import ProxyUnderTest

ROOT = Path(__file__).resolve().parents[2]
STAGES = [s.value for s in (SessionStage.QUEUED, SessionStage.INIT, SessionStage.READY, SessionStage.RUNNING,
                            SessionStage.POST_RUN, SessionStage.TEARDOWN)]


async def publish(kafka: KafkaSettings, *specs: SessionSpec) -> None:
    async with EventProducer(kafka, service="test") as producer:
        await producer.send_many(list(specs))


class Lifecycle:
    """The session-events topic, read from the beginning in the background, per session."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.events: dict[str, list[SessionStageChanged | SessionEnded]] = defaultdict(list)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lifecycle:
        consumer = EventConsumer(self.kafka, [Topic.SESSION_EVENTS], group_id=None, dead_letters=False)
        await consumer.start()

        async def follow() -> None:
            try:
                while True:
                    for received in await consumer.getmany(timeout_ms=100):
                        event = received.event
                        assert isinstance(event, (SessionStageChanged, SessionEnded))
                        self.events[event.session_id].append(event)
            finally:
                await consumer.stop()

        self._task = asyncio.create_task(follow())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def ends(self, session_id: str) -> list[SessionEnded]:
        return [e for e in self.events[session_id] if isinstance(e, SessionEnded)]

    def stages(self, session_id: str) -> list[SessionStageChanged]:
        return [e for e in self.events[session_id] if isinstance(e, SessionStageChanged)]

    async def wait(self, check: Any, timeout_s: float = 60, what: str = "events") -> None:
        async def loop() -> None:
            while not check():
                await asyncio.sleep(0.1)
        try:
            await asyncio.wait_for(loop(), timeout_s)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}: {dict(self.events)}") from None

    async def ended(self, *session_ids: str, timeout_s: float = 60) -> dict[str, SessionEnded]:
        await self.wait(lambda: all(self.ends(s) for s in session_ids), timeout_s, "session ends")
        await asyncio.sleep(0.5)  # a second end, if there were one, would show up now
        return {s: self.ends(s)[0] for s in session_ids}


def node_settings(proxy: ProxyUnderTest, **overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = dict(proxy_url=proxy.url, port=0, run_slots=2, prewarm=1, init_workers=2,
                                  recheck_s=0.5, node_name=f"node-{uuid.uuid4().hex[:6]}")
    values.update(overrides)
    return GatewaySettings(**values)


@contextlib.asynccontextmanager
async def running_node(settings: GatewaySettings, kafka: KafkaSettings, root: Path) -> AsyncIterator[GatewayNode]:
    """A node in this process (local runtime under ``root``); drained at the end of the block."""
    node = GatewayNode(settings, kafka, runtime_for=lambda kind: LocalRuntime(root=root))
    task = asyncio.create_task(node.run())
    await asyncio.wait_for(node.started.wait(), 30)
    try:
        yield node
    finally:
        node.stop_now()
        await asyncio.wait_for(task, 60)


def start_node(kafka: KafkaSettings, proxy: ProxyUnderTest, root: Path, name: str, **settings: Any) -> subprocess.Popen:
    env = {**os.environ, "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap, "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix,
           "ROLLWIRE_SESSION_PARTITIONS": str(kafka.session_partitions),
           "ROLLWIRE_TASK_PARTITIONS": str(kafka.task_partitions), "ROLLWIRE_RUNTIME_ROOT": str(root),
           "ROLLWIRE_GATEWAY_PROXY_URL": proxy.url, "ROLLWIRE_GATEWAY_NODE_NAME": name,
           "ROLLWIRE_GATEWAY_PORT": "0", "ROLLWIRE_GATEWAY_RECHECK_S": "0.5"}
    env.update({f"ROLLWIRE_GATEWAY_{k.upper()}": str(v) for k, v in settings.items()})
    log = open(root.parent / f"{name}.log", "w")  # noqa: SIM115 - the process owns it
    return subprocess.Popen([sys.executable, "-m", "producers.gateway.cli"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)
