"""A weight update sent to every engine of the pool, all or none: each step runs at once on every engine
healthy when the update began, and a step that fails on any engine fails the update, so the policy rolls
every engine back.

The control plane goes to each engine directly, never through placement. The engines an update pauses
are the ones it drives to the end, rolls back and resumes, whatever their health says meanwhile: an engine
busy loading may not answer /health, and one dropped half-way would stay paused. An engine that is
unhealthy when the update starts gets no part of it; it is brought to the new weights when it comes back
(:meth:`proxy.fleet.pool.EnginePool._check`). Each engine's part is reported for the update's event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from proxy.errors import ProxyError, WeightApiMissing, WeightUpdateFailed
from proxy.fleet.pool import Engine, EnginePool
from schemas.policy import EngineUpdate

T = TypeVar("T")


class PoolWeights:
    """The weight endpoints of every healthy engine, driven as one (what :class:`proxy.policy.Policy` uses)."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self._report: dict[str, EngineUpdate] = {}
        self._started: dict[str, float] = {}
        self._path: str | None = None
        self._version: str | None = None
        self._holding = False  # this update holds the pool's weights lock (no engine rejoins meanwhile)
        self._paused: list[Engine] | None = None  # the engines this update paused, until it resumes them

    def _targets(self) -> list[Engine]:
        if self._paused is not None:
            return self._paused
        healthy = [engine for engine in self.pool.engines.values() if engine.healthy]
        return healthy or list(self.pool.engines.values())[:1]

    async def _each(self, step: str, call: Callable[[Engine], Awaitable[T]]) -> list[T]:
        """``call`` on every target engine at once; the first failure raised once all have answered, naming
        the engines that failed."""
        engines = self._targets()
        results = await asyncio.gather(*(call(engine) for engine in engines), return_exceptions=True)
        failures = [(engine, result) for engine, result in zip(engines, results, strict=True)
                    if isinstance(result, BaseException)]
        for engine, error in failures:
            message = error.message if isinstance(error, ProxyError) else repr(error)
            self._report[engine.id] = EngineUpdate(engine=engine.id, status="failed", error=f"{step}: {message}",
                                                   load_ms=self._elapsed(engine))
        if failures:
            first = failures[0][1]
            if isinstance(first, WeightApiMissing) and len(failures) == len(engines):
                raise first
            names = ", ".join(f"{engine.id} ({e.message if isinstance(e, ProxyError) else e!r})"
                              for engine, e in failures)
            raise WeightUpdateFailed(f"{step} failed on {len(failures)} of {len(engines)} engines: {names}")
        return [result for result in results if not isinstance(result, BaseException)]

    def _elapsed(self, engine: Engine) -> float:
        started = self._started.get(engine.id)
        return (time.perf_counter() - started) * 1000 if started is not None else 0.0

    # -- reads ----------------------------------------------------------------------------------------
    async def weight_version(self) -> str | None:
        """The version the pool serves (its engines agree; the lowest if they do not, so that an update is
        never refused as not newer than an engine that missed the last one)."""
        versions = await self._each("reading the weight version", lambda engine: engine.weights.weight_version())
        known = [version for version in versions if version is not None]
        for engine, version in zip(self._targets(), versions, strict=False):
            engine.version = version
        if not known:
            return None
        return min(known, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v))

    async def served_folder(self) -> str | None:
        return await self.pool.any().weights.served_folder()

    async def is_cpu_build(self) -> bool:
        return any(await self._each("reading the device", lambda engine: engine.weights.is_cpu_build()))

    # -- the update's steps ---------------------------------------------------------------------------
    async def pause(self) -> None:
        self._report = {}
        self._started = {engine.id: time.perf_counter() for engine in self._targets()}
        await self.pool.weights_lock.acquire()
        self._holding = True
        self._paused = self._targets()  # an engine that answers the pause late is resumed all the same
        try:
            await self._each("pausing", lambda engine: engine.weights.pause())
        except ProxyError:
            raise  # the policy resumes the engines (resume_quietly), which releases the lock
        except BaseException:
            self._release()
            raise

    async def reload_weights(self, weights_path: str) -> None:
        self._path = weights_path
        try:
            await self._each("loading the weights", lambda engine: engine.weights.reload_weights(weights_path))
        except ProxyError:
            for engine in self._targets():  # the policy restores every engine: each one's part is rolled back
                if engine.id not in self._report:
                    self._report[engine.id] = EngineUpdate(engine=engine.id, status="rolled_back",
                                                           load_ms=self._elapsed(engine))
            raise

    async def set_version(self, version: str) -> None:
        self._version = version
        await self._each("setting the version", lambda engine: engine.weights.set_version(version))

    async def reset_prefix_cache(self) -> bool:
        return all(await self._each("resetting the prefix cache", lambda engine: engine.weights.reset_prefix_cache()))

    async def resume(self) -> None:
        engines = self._targets()
        try:
            await self._each("resuming", lambda engine: engine.weights.resume())
        finally:
            self._release()
        if self._path is not None and self._version is not None:
            self.pool.target = (self._path, self._version)
        for engine in engines:
            engine.version = self._version
            self._report.setdefault(engine.id, EngineUpdate(engine=engine.id, load_ms=self._elapsed(engine)))

    async def resume_quietly(self) -> str | None:
        try:
            await self._each("resuming", lambda engine: engine.weights.resume())
        except ProxyError as exc:
            return exc.message
        finally:
            self._release()
        return None

    def _release(self) -> None:
        """The update is over: the lock goes back and the targets are the healthy engines again."""
        self._paused = None
        if self._holding:
            self._holding = False
            self.pool.weights_lock.release()

    def follow(self, weights_path: str, version: str) -> None:
        """The pool now serves ``weights_path`` as ``version``, loaded by another proxy process's update: an
        engine that rejoins is brought to them."""
        self.pool.target = (weights_path, version)
        for engine in self._targets():
            engine.version = version

    def report(self) -> list[EngineUpdate]:
        """Each engine's part of the last update (empty before the first)."""
        return list(self._report.values())
