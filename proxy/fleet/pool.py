"""The pool of engines: one client each, where each call goes, and which engines are fit for calls.

Health is watched two ways. Actively: every ``engine_health_interval_s`` each engine's ``/health`` is read
(and its prefix-cache counters, for ``/metrics``). Passively: a call that cannot reach its engine marks the
engine unhealthy at once. An unhealthy engine gets no new calls; it comes back when ``/health`` answers,
after it has been brought to the pool's current weights and version (an engine that restarts loads its
start-up checkpoint, which the pool may have moved past).

A call holds its engine from placement to its last byte (:meth:`EnginePool.acquire` / :meth:`release`):
that count is the load placement balances, and the cap a pinned branch may wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxy.continuation.exact import Continuations
from proxy.continuation.token_api import TokenApi
from proxy.engine import VllmEngine
from proxy.errors import EngineUnavailable, ProxyError
from proxy.fleet.entries import EngineEntry, PoolConfigError, configured_entries
from proxy.fleet.placement import Load, choose, pin_is_full
from proxy.settings import ProxySettings
from proxy.weight_api import WeightApi

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 2.0
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
_PREFIX_HITS = "vllm:prefix_cache_hits_total"


@dataclass
class Engine:
    """One engine of the pool and what the proxy knows of it."""

    entry: EngineEntry
    client: VllmEngine
    tokens: TokenApi
    continuations: Continuations
    weights: WeightApi
    healthy: bool = True
    in_flight: int = 0
    calls: int = 0
    errors: int = 0
    version: str | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    down_since: float | None = None
    leaving: bool = False  # taken out of the pool file: no new calls, removed once its calls are done
    room: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def prefix_hit_rate(self) -> float | None:
        """The engine's own prefix-cache hit rate since it started (hit tokens ÷ queried tokens)."""
        if not self.prefix_queries:
            return None
        return (self.prefix_hits or 0.0) / self.prefix_queries

    def load(self) -> Load:
        return Load(self.id, self.healthy, self.in_flight)


def _counter(metrics_text: str, name: str) -> float | None:
    """The sum of a Prometheus counter's samples over its labels, from a /metrics page."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
    return total if seen else None


class EnginePool:
    """The engines the proxy serves from, with placement and health (see the module docstring)."""

    def __init__(self, settings: ProxySettings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self._transport = transport
        self.engines: dict[str, Engine] = {}
        self._turn = 0
        self._watch: asyncio.Task[None] | None = None
        self._pool_file_stamp: float | None = None
        # The checkpoint and version the pool serves after its last weight update; an engine that rejoins
        # is brought to them first. None: the engines' start-up weights.
        self.target: tuple[str, str] | None = None
        self.weights_lock = asyncio.Lock()
        for entry in configured_entries(settings.engine_url, settings.engine_urls, settings.engine_pool_file):
            self._add(entry)

    # -- membership -----------------------------------------------------------------------------------
    def _add(self, entry: EngineEntry) -> Engine:
        client = VllmEngine(self.settings.model_copy(update={"engine_url": entry.url}), transport=self._transport)
        tokens = TokenApi(client.client)
        engine = Engine(entry, client, tokens, Continuations(tokens),
                        WeightApi(client.client, self.settings.weight_update_timeout_s))
        engine.room.set()
        self.engines[entry.id] = engine
        return engine

    async def _reread_pool_file(self) -> None:
        """Engines named in the pool file join; engines no longer named leave once their calls are done."""
        path = self.settings.engine_pool_file
        if not path:
            return
        for engine_id in [e.id for e in self.engines.values() if e.leaving and e.in_flight == 0]:
            logger.info("engine %s leaves the pool", engine_id)
            await self.engines.pop(engine_id).client.aclose()
        try:
            stamp = Path(path).expanduser().stat().st_mtime
        except OSError:
            return
        if stamp == self._pool_file_stamp:
            return
        self._pool_file_stamp = stamp
        try:
            wanted = {entry.id: entry for entry in configured_entries(self.settings.engine_url, None, path)}
        except PoolConfigError as exc:
            logger.error("the pool file was not applied: %s", exc.message)
            return
        for engine_id, entry in wanted.items():
            if engine_id not in self.engines:
                logger.info("engine %s joins the pool (%s)", engine_id, entry.url)
                self._add(entry).healthy = False  # serves once its health check passes
            elif self.engines[engine_id].leaving:
                self.engines[engine_id].leaving = False  # named again: back once its health check passes
        for engine_id in [engine_id for engine_id in self.engines if engine_id not in wanted]:
            engine = self.engines[engine_id]
            engine.leaving, engine.healthy = True, False  # no new calls; removed once its calls are done
            if engine.in_flight == 0:
                logger.info("engine %s leaves the pool", engine_id)
                del self.engines[engine_id]
                await engine.client.aclose()

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Check every engine once (a model other than the pool's is refused here), then watch them."""
        if self.settings.engine_pool_file:
            self._pool_file_stamp = Path(self.settings.engine_pool_file).expanduser().stat().st_mtime
        await self.check_models()
        await asyncio.gather(*(self._check(engine) for engine in list(self.engines.values())))
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def check_models(self) -> None:
        """Every engine that answers serves the same model; :class:`PoolConfigError` names any that does not.

        Read from each engine's own ``/v1/models`` list: the engine client's ``served_model`` answers the
        configured name (``ROLLWIRE_SERVED_MODEL``) without asking, which would hide an engine serving another."""
        async def models_of(engine: Engine) -> list[str] | None:
            try:
                response = await engine.client.client.get("/v1/models", timeout=_HEALTH_TIMEOUT_S * 2)
                response.raise_for_status()
                return [str(model["id"]) for model in response.json()["data"]]
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                return None

        listed = dict(zip(self.engines, await asyncio.gather(*(models_of(e) for e in self.engines.values())),
                          strict=True))
        if self.settings.served_model is None:
            models = {engine_id: ids[0] for engine_id, ids in listed.items() if ids}
            if len(set(models.values())) > 1:
                raise PoolConfigError("the pool's engines serve different models ("
                                      + ", ".join(f"{engine_id}: {model}" for engine_id, model in models.items())
                                      + "): one pool serves one policy")
            return
        other = {engine_id: ", ".join(ids) for engine_id, ids in listed.items()
                 if ids is not None and self.settings.served_model not in ids}
        if other:
            raise PoolConfigError(f"engines {', '.join(sorted(other))} do not serve "
                                  f"{self.settings.served_model!r} (ROLLWIRE_SERVED_MODEL): {other}")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for engine in self.engines.values():
            await engine.client.aclose()

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_health_interval_s)
            try:
                await self._reread_pool_file()
                await asyncio.gather(*(self._check(engine) for engine in list(self.engines.values())))
            except Exception:  # the watch must outlive any one engine's odd answer
                logger.exception("engine health check failed")

    async def _check(self, engine: Engine) -> None:
        """Read the engine's /health and prefix-cache counters; bring a returning engine up to date first."""
        client = engine.client.client
        try:
            health = await client.get("/health", timeout=_HEALTH_TIMEOUT_S)
            ok = health.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            self._mark_down(engine, "its /health does not answer")
            return
        with contextlib.suppress(httpx.HTTPError):
            page = await client.get("/metrics", timeout=_HEALTH_TIMEOUT_S)
            if page.status_code == 200:
                engine.prefix_queries = _counter(page.text, _PREFIX_QUERIES)
                engine.prefix_hits = _counter(page.text, _PREFIX_HITS)
        if not engine.healthy and not engine.leaving and engine.entry.id in self.engines:
            if await self._bring_up_to_date(engine):
                engine.healthy, engine.down_since = True, None
                logger.info("engine %s is back in the pool", engine.id)
                engine.room.set()

    async def _bring_up_to_date(self, engine: Engine) -> bool:
        """An engine coming back serves the pool's current weights and version before it gets calls."""
        async with self.weights_lock:
            target = self.target
            if target is None:
                return True
            path, version = target
            try:
                if await engine.weights.weight_version() == version:
                    return True
                logger.info("engine %s rejoins: loading %s as version %s first", engine.id, path, version)
                await engine.weights.pause()
                try:
                    await engine.weights.reload_weights(path)
                    await engine.weights.set_version(version)
                    await engine.weights.reset_prefix_cache()
                finally:
                    await engine.weights.resume_quietly()
            except ProxyError as exc:
                logger.warning("engine %s could not be brought to version %s: %s", engine.id, version, exc.message)
                return False
            engine.version = version
            return True

    def _mark_down(self, engine: Engine, why: str) -> None:
        if engine.healthy:
            logger.warning("engine %s leaves the pool's rotation: %s", engine.id, why)
        engine.healthy = False
        engine.down_since = engine.down_since or time.monotonic()
        engine.room.set()  # whoever waits for room there must look elsewhere

    # -- the hot path ---------------------------------------------------------------------------------
    def any(self) -> Engine:
        """An engine to ask what the pool serves (the model, its context): a healthy one if any."""
        return next((e for e in self.engines.values() if e.healthy), next(iter(self.engines.values())))

    async def serving(self) -> Engine:
        """An engine that answers what the pool serves (its model, its context): the healthy ones first, then
        the others, since an engine that has just come back may not have been checked yet. Raises the last
        engine's error when none answers."""
        ordered = sorted(self.engines.values(), key=lambda e: not e.healthy)
        error: ProxyError | None = None
        for engine in ordered:
            try:
                await engine.client.served_model()
                return engine
            except ProxyError as exc:
                error = exc
        assert error is not None
        raise error

    def _choose(self, pinned: str | None, session_id: str, exclude: frozenset[str]) -> Engine | None:
        loads = [engine.load() for engine in self.engines.values() if engine.id not in exclude]
        self._turn += 1
        chosen = choose(self.settings.engine_placement, loads, pinned=pinned, session_id=session_id,
                        cap=self.settings.engine_max_in_flight, turn=self._turn)
        return self.engines.get(chosen) if chosen is not None else None

    async def acquire(self, pinned: str | None, session_id: str,
                      exclude: frozenset[str] = frozenset()) -> Engine:
        """The engine for a call, held until :meth:`release`; :class:`EngineUnavailable` (503) when none is
        healthy. A branch pinned to an engine at its cap waits up to ``engine_pin_wait_s`` for room there when
        another engine could take it; with nowhere else to go it stays on its pin at once."""
        pin = self.engines.get(pinned) if pinned is not None else None
        loads = [engine.load() for engine in self.engines.values() if engine.id not in exclude]
        if (pin is not None and self.settings.engine_placement == "sticky_least_loaded"
                and pinned not in exclude and pin_is_full(loads, pinned, self.settings.engine_max_in_flight)):
            deadline = time.monotonic() + self.settings.engine_pin_wait_s
            while pin.healthy and pin.in_flight >= self.settings.engine_max_in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                pin.room.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(pin.room.wait(), left)
        engine = self._choose(pinned, session_id, exclude)
        if engine is None:
            # No engine is known healthy: try one not tried yet anyway (health is read every few seconds, and
            # a call is the quickest probe), so that the harness gets the engine's own error, and a pool that
            # comes back serves at once.
            untried = [e for e in self.engines.values() if e.id not in exclude]
            if not untried:
                raise EngineUnavailable(f"no engine of the pool can be reached (tried {', '.join(sorted(exclude))}); "
                                        "retry shortly")
            engine = min(untried, key=lambda e: (e.in_flight, e.down_since or 0.0))
        engine.in_flight += 1
        engine.calls += 1
        return engine

    def release(self, engine: Engine, *, failed: bool = False) -> None:
        engine.in_flight -= 1
        if failed:
            engine.errors += 1
        engine.room.set()

    def unreachable(self, engine: Engine, error: ProxyError) -> None:
        """A call could not reach ``engine`` (refused, reset before the first byte): no new calls go there."""
        self._mark_down(engine, error.message)

    def states(self) -> list[dict[str, object]]:
        """Each engine as ``GET /v1/engines`` and ``rollwire status`` show it."""
        return [{"id": e.id, "url": e.entry.url, "healthy": e.healthy, "in_flight": e.in_flight, "calls": e.calls,
                 "errors": e.errors, "version": e.version, "prefix_cache_hit_rate": e.prefix_hit_rate}
                for e in self.engines.values()]

