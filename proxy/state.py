"""The proxy's running parts, made at start and shared by every route through ``app.state``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from starlette.requests import HTTPConnection

from proxy.calls import CallService
from proxy.continuation.restore import BranchRestorer
from proxy.capture import Recorder
from proxy.engine import VllmEngine
from proxy.fleet.pool import EnginePool
from proxy.fleet.weights import PoolWeights
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.policy_tier import PolicyTier
from proxy.session_registry import RegistryFeed, SessionRegistry
from proxy.settings import ProxySettings
from proxy.tier.claims import CallNumbers
from schemas.transport import KafkaSettings

_REGISTRY_WAIT_S = 3.0  # how long the claims reader waits for the registry to say where to start
_CLAIM_WAIT_S = 30.0  # the least a call waits for its claim to be read back (a process's first calls)


@dataclass
class ProxyState:
    """What a running proxy holds: its settings, the session registry, the capture, the engine and policy."""

    settings: ProxySettings
    kafka: KafkaSettings
    registry: SessionRegistry
    feed: RegistryFeed
    recorder: Recorder
    pool: EnginePool
    policy: Policy
    service: CallService
    metrics: ProxyMetrics
    max_body_bytes: int
    numbers: CallNumbers
    restorer: BranchRestorer

    @classmethod
    def build(cls, settings: ProxySettings, kafka: KafkaSettings,
              engine_transport: httpx.AsyncBaseTransport | None = None) -> ProxyState:
        """Every part wired to the others; nothing is started yet (see :meth:`start`)."""
        metrics = ProxyMetrics()
        registry = SessionRegistry()
        recorder = Recorder(kafka, settings.capture_timeout_s, settings.capture_producers,
                            on_outage_end=metrics.capture_outages.observe, compression=settings.capture_compression)
        metrics.capture_failing.set_function(lambda: float(recorder.failing_since is not None))

        def compressed_by(by: str) -> Callable[[], float]:
            return lambda: float(recorder.compression == by)

        for by in ("producer", "broker", "auto"):
            metrics.capture_compression.labels(by=by).set_function(compressed_by(by))
        pool = EnginePool(settings, transport=engine_transport)
        policy = Policy(PoolWeights(pool), recorder, metrics, lambda: pool.any().client.served_model(),
                        settings.policy_floor_wait_s)
        policy.tier = PolicyTier(settings, kafka, recorder, policy)  # its updates across the proxy tier
        feed = RegistryFeed(kafka, registry)

        async def live_since() -> int | None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(feed.caught_up.wait(), _REGISTRY_WAIT_S)
                return registry.live_since_ms() or int(time.time() * 1000)
            return None  # the registry is slow to catch up: every retained claim is read

        # A process's first calls wait for its reader of the claims to start as well as for Kafka's ack.
        numbers = CallNumbers(kafka, recorder, settings.instance, max(settings.capture_timeout_s, _CLAIM_WAIT_S),
                              live_since)
        # A call claimed by a process that then died never gets an event; after the longest a call can take
        # (the engine's wait plus the capture's), no event will ever come for it.
        restorer = BranchRestorer(kafka, settings.restore_timeout_s,
                                  settings.engine_timeout_s + settings.capture_timeout_s + 60)
        service = CallService(pool, recorder, metrics, policy, numbers, restorer,
                              upstream_stream=settings.upstream_stream)
        metrics.watch_engines(pool.states)
        return cls(settings, kafka, registry, feed, recorder, pool, policy, service, metrics,
                   settings.max_body_bytes(kafka.max_message_bytes), numbers, restorer)

    async def start(self) -> None:
        await self.pool.start()
        await self.recorder.start()
        self.feed.start()
        self.policy.start_tier()
        self.numbers.start()
        await self.policy.learn()  # the engine's version now if it is up; else the first call asks

    async def stop(self) -> None:
        # Calls the shutdown grace cut are recorded (as proxy_stopped) before the producer closes.
        self.service.begin_stop()
        await self.service.drain(self.settings.capture_timeout_s)
        await self.feed.stop()
        await self.policy.stop_tier()
        await self.numbers.stop()
        await self.restorer.stop()
        await self.recorder.stop()
        await self.pool.stop()

    @property
    def engine(self) -> VllmEngine:
        """An engine client to ask what the pool serves (its model, its context, token counts)."""
        return self.pool.any().client


def proxy_state(connection: HTTPConnection) -> ProxyState:
    """The running proxy's parts, from the app serving ``connection``."""
    state: ProxyState = connection.app.state.proxy
    return state
