"""The policy the engine serves: its weight version, the gate that model calls pass, and weight updates.

Every model call passes :meth:`Policy.admit` before it reaches the engine and leaves once the engine is
done with it (:meth:`Admission.leave`). While the gate is open that costs a flag test and a counter; the
call runs under the version known then, which the proxy stamps on its completion event (the engine's
own ``weight_versions`` spans win on the token path, see :func:`sampled_version`).

A weight update (:meth:`Policy.update`, ``POST /v1/policy/weights``) closes the gate (new calls wait: the
harness sees a slower reply, never an error), waits for the calls in flight to finish on the old weights,
has the engine pause, load the checkpoint, take the new version, drop its prefix cache and resume
(:mod:`proxy.weight_api`), reopens the gate and writes a :class:`~schemas.policy.WeightsUpdated` event
to the ``policy`` topic. Because nothing runs on the engine while it changes, a call's version is known
exactly. One update at a time; versions only go up.

A session whose ``policy_version`` is a number (``"7"``, ``"v7"``) is a floor: its calls wait until the
engine serves that version or a newer one, up to ``ROLLWIRE_POLICY_FLOOR_WAIT_S``, then fail with a 503
in the caller's protocol. The engine's version is read from ``GET /weight_info`` on the first call, on
``GET /v1/policy`` and after each update; an engine without that endpoint (vLLM without
``VLLM_SERVER_DEV_MODE=1``) leaves it unknown: completions then carry no version and floors are not held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from proxy.capture import Recorder
from proxy.errors import (
    CheckpointRefused,
    DrainTimeout,
    PolicyConflict,
    PolicyNotReady,
    ProxyError,
    WeightApiMissing,
    WeightUpdateFailed,
)
from proxy.metrics import ProxyMetrics
from proxy.weight_api import WeightApi, tied_head_missing
from schemas.api import PolicyState, WeightUpdate
from schemas.policy import INITIAL_VERSION, WeightsUpdated, version_number

logger = logging.getLogger(__name__)

_ENGINE_INITIAL = ("", "default")  # what vLLM reports before its first update


def engine_version(reported: str | None) -> str:
    """The policy version of a version the engine reports: vLLM's ``"default"`` is the initial weights, 0."""
    if reported is None or reported.strip() in _ENGINE_INITIAL:
        return str(INITIAL_VERSION)
    return reported


def sampled_version(spans: list[dict[str, Any]] | None) -> str | None:
    """The version a call was sampled under, from generate's ``weight_versions`` spans: the oldest one (a
    call that straddles an update began on the older weights); None when the engine gave no spans."""
    versions = [engine_version(str(span["version"])) for span in spans or ()
                if isinstance(span, dict) and span.get("version") is not None]
    numbered = [(number, version) for version in versions if (number := version_number(version)) is not None]
    if numbered:
        return min(numbered)[1]
    return versions[0] if versions else None


def floor_of(policy_version: str | None) -> int | None:
    """The version a session's calls need at least: its ``policy_version`` when that is a number
    (older tasks name versions like ``"step-12"``: not a floor)."""
    return version_number(policy_version)


class Admission:
    """One call let through to the engine, and the version it runs under; ``leave`` once the engine is done."""

    __slots__ = ("_policy", "_left", "version")

    def __init__(self, policy: Policy, version: str | None) -> None:
        self._policy = policy
        self._left = False
        self.version = version

    def leave(self) -> None:
        """The call no longer uses the engine (may be called again: only the first counts)."""
        if not self._left:
            self._left = True
            self._policy._leave()


class Policy:
    """The engine's weight version, the gate in front of it, and the update routine (one per proxy)."""

    def __init__(self, weights: WeightApi, recorder: Recorder, metrics: ProxyMetrics,
                 served_model: Callable[[], Awaitable[str]], floor_wait_s: float) -> None:
        self.weights = weights
        self.recorder = recorder
        self.metrics = metrics
        self.served_model = served_model
        self.floor_wait_s = floor_wait_s
        self.version: str | None = None  # None: not known (yet, or the engine does not say)
        self.weights_path: str | None = None  # the checkpoint serving now, restored if an update fails
        self.updates = 0
        self.last_paused_ms: float | None = None
        self.updating_to: str | None = None
        self.held = 0
        self.in_flight = 0
        self._known = False
        self._learning = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Event()  # set, then replaced, whenever the version changes
        self._idle: asyncio.Event | None = None  # set when the last call in flight leaves during a drain
        self._held_this_update = 0

    # -- the hot path ---------------------------------------------------------------------------------
    async def admit(self, floor: int | None) -> Admission:
        """Let a call through to the engine: at once when no update runs and the engine serves ``floor`` or
        newer, else once that holds (:class:`PolicyNotReady` when a floor is not reached in time)."""
        if not self._known:
            await self.learn()
        if not self._open.is_set() or not self._serves(floor):
            await self._hold(floor)
        self.in_flight += 1  # no await since the gate was seen open: a closing update counts this call
        return Admission(self, self.version)

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def _serves(self, floor: int | None) -> bool:
        if floor is None:
            return True
        current = version_number(self.version)
        return current is None or current >= floor  # an engine that gives no number cannot be held to one

    async def _hold(self, floor: int | None) -> None:
        """Wait while an update runs (as long as it takes), and for ``floor`` until ``floor_wait_s`` after the
        call arrived (checked whenever the gate is open)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.floor_wait_s
        self.held += 1
        if self.updating_to is not None:
            self._held_this_update += 1
        self.metrics.calls_held.inc()
        self.metrics.calls_held_total.inc()
        try:
            while True:
                if not self._open.is_set():
                    await self._open.wait()
                elif self._serves(floor):
                    return
                else:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise PolicyNotReady(
                            f"this session's calls need policy version {floor} or newer; the engine serves "
                            f"version {self.version}, and no update to {floor} came within "
                            f"{self.floor_wait_s:g} s (ROLLWIRE_POLICY_FLOOR_WAIT_S); retry later")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), remaining)
        finally:
            self.held -= 1
            self.metrics.calls_held.dec()

    # -- the engine's version -----------------------------------------------------------------------------
    def _set_version(self, version: str | None) -> None:
        if version == self.version:
            return
        self.version = version
        number = version_number(version)
        self.metrics.policy_version.set(-1 if number is None else number)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def learn(self) -> None:
        """Read the engine's version once. An engine without the endpoint leaves it unknown for good; one
        that cannot be reached is asked again by the next call (this one runs with the version unknown)."""
        async with self._learning:
            if self._known:
                return
            try:
                reported = await self.weights.weight_version()
            except WeightApiMissing as exc:
                self._known = True
                logger.info("%s; completions carry no policy version, and session floors are not held",
                            exc.message)
                return
            except ProxyError as exc:
                logger.warning("could not read the engine's weight version: %s", exc.message)
                return
            self._known = True
            self._set_version(engine_version(reported))

    async def refresh(self) -> None:
        """Read the engine's version again (not while an update runs: it sets the version itself)."""
        if self.updating_to is None:
            self._known = False
            await self.learn()

    def state(self, served_model: str | None) -> PolicyState:
        """What ``GET /v1/policy`` answers; :class:`WeightApiMissing` when the engine gives no version."""
        if self.version is None:
            raise WeightApiMissing("the engine reports no weight version (vLLM serves GET /weight_info only with "
                                   "VLLM_SERVER_DEV_MODE=1), so this proxy cannot track or update its policy")
        return PolicyState(served_model=served_model, version=self.version, updating=self.updating_to is not None,
                           holding=not self._open.is_set(), updates=self.updates, last_paused_ms=self.last_paused_ms, held_calls=self.held)

    # -- weight updates -------------------------------------------------------------------------------
    async def update(self, request: WeightUpdate) -> PolicyState:
        """Load ``request.weights_path`` into the engine as ``request.version`` (see the module docstring).

        Raises :class:`PolicyConflict` (another update runs, or the version is not newer), ProxyError on an
        engine that cannot be asked, :class:`DrainTimeout` and :class:`WeightUpdateFailed` (the gate reopened,
        a failed event written). Run it shielded: a caller that goes away must not leave the gate closed."""
        if self.updating_to is not None:
            raise PolicyConflict(f"a weight update to version {self.updating_to} is in progress; one at a time")
        self.updating_to = request.version
        try:
            model = await self._update(request)
        finally:
            self.updating_to = None
        return self.state(model)

    async def _update(self, request: WeightUpdate) -> str:
        """The update's steps; returns the served model's name."""
        began = time.perf_counter()
        reported = await self.weights.weight_version()
        asked_version = time.perf_counter()
        previous = engine_version(reported)
        self._known = True
        self._set_version(previous)
        current, wanted = version_number(previous), version_number(request.version)
        if current is not None and wanted is not None and wanted <= current:
            raise PolicyConflict(f"versions only go up: the engine serves version {previous}, and "
                                 f"{request.version} is not newer")
        await self._check_checkpoint(request.weights_path)
        checked = time.perf_counter()
        model = await self.served_model()
        if self.weights_path is None:
            self.weights_path = await self.weights.served_folder()
        closed = time.perf_counter()
        # Everything before the gate closes runs beside the calls in flight; slow here is an engine slow to
        # answer its small GETs (seen: a CPU engine busy with a long stream), worth seeing in the log.
        logger.info("weight update to %s: checks took %.0f ms (version %.0f, checkpoint %.0f, model %.0f); "
                    "closing the gate on %d calls in flight", request.version, (closed - began) * 1000,
                    (asked_version - began) * 1000, (checked - asked_version) * 1000, (closed - checked) * 1000,
                    self.in_flight)
        self._open.clear()
        self._held_this_update = 0
        drained = self.in_flight
        failure: ProxyError | None = None
        load_ms = 0.0
        try:
            await self._drain(request.drain_timeout_s)
            load_ms = await self._swap(request, reported or previous)
            self._set_version(request.version)
        except ProxyError as exc:
            failure = exc
            if not isinstance(exc, DrainTimeout):
                await self.refresh_after_failure()
        finally:
            self._open.set()  # held calls go on, whatever happened (cancellation included)
        paused_ms = (time.perf_counter() - closed) * 1000
        if failure is not None:
            await self._emit(model, request, previous, "failed", paused_ms, load_ms, drained, failure.message)
            raise failure
        self.updates += 1
        self.last_paused_ms = paused_ms
        await self._emit(model, request, previous, "ok", paused_ms, load_ms, drained, None)
        return model

    async def _check_checkpoint(self, weights_path: str) -> None:
        """Refuse a checkpoint a CPU engine would load wrong (see :mod:`proxy.weight_api`), when readable here."""
        if await asyncio.to_thread(tied_head_missing, weights_path) and await self.weights.is_cpu_build():
            raise CheckpointRefused(
                f"{weights_path} ties lm_head to the embeddings but does not store lm_head.weight: vLLM's CPU "
                "build would keep its old output layer. Save lm_head.weight too (the embedding matrix again), "
                "e.g. state_dict['lm_head.weight'] = state_dict['model.embed_tokens.weight'].clone()")

    async def _drain(self, timeout_s: float) -> None:
        """Wait for the calls in flight to finish on the current weights."""
        if self.in_flight == 0:
            return
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError as exc:
            raise DrainTimeout(f"{self.in_flight} calls were still running on the engine after {timeout_s:g} s "
                               "(drain_timeout_s); nothing was changed, and held calls went on") from exc
        finally:
            self._idle = None

    async def _swap(self, request: WeightUpdate, reported: str) -> float:
        """Pause the engine, load the weights, set the version, drop the prefix cache, resume; the load's ms.

        On a failed step the engine gets its previous checkpoint and version back (a failed load leaves
        vLLM's model half-loaded), is resumed, and :class:`WeightUpdateFailed` says what happened."""
        loading = False
        try:
            await self.weights.pause()
            loading = True
            started = time.perf_counter()
            await self.weights.reload_weights(request.weights_path)
            load_ms = (time.perf_counter() - started) * 1000
            await self.weights.set_version(request.version)
            if not await self.weights.reset_prefix_cache():
                logger.warning("the engine could not reset its prefix cache after the update (pausing cleared it)")
        except ProxyError as exc:
            notes = [exc.message]
            if loading:
                notes.append(await self._restore(reported))
            if (failed := await self.weights.resume_quietly()) is not None:
                notes.append(f"resuming the engine failed too: {failed}")
            raise WeightUpdateFailed("; ".join(notes)) from exc
        await self.weights.resume()
        self.weights_path = request.weights_path
        return load_ms

    async def _restore(self, reported: str) -> str:
        """Load the checkpoint that served before and set its version (as the engine named it) again; says
        what came of it."""
        if self.weights_path is None:
            return "the engine did not say which checkpoint it served before, so it was not restored"
        try:
            await self.weights.reload_weights(self.weights_path)
            await self.weights.set_version(reported)
            await self.weights.reset_prefix_cache()
        except ProxyError as exc:
            logger.error("restoring %s after a failed weight update failed too: %s", self.weights_path, exc.message)
            return f"restoring the previous weights ({self.weights_path}) failed too, so the engine may be " \
                   f"unusable: {exc.message}"
        logger.warning("weight update failed; the engine serves its previous weights again (%s)", self.weights_path)
        return f"the engine serves its previous weights ({self.weights_path}) again"

    async def refresh_after_failure(self) -> None:
        """After a failed step the engine's version is whatever it says (a step may have gone through)."""
        with contextlib.suppress(ProxyError):
            self._set_version(engine_version(await self.weights.weight_version()))

    async def _emit(self, model: str, request: WeightUpdate, previous: str, status: Literal["ok", "failed"],
                    paused_ms: float, load_ms: float, drained: int, error: str | None) -> None:
        """The update's event on the ``policy`` topic, and its metrics. A Kafka failure is logged: the
        engine has changed either way, and the answer must say so."""
        self.metrics.weight_updates.labels(status=status).inc()
        self.metrics.pause_seconds.observe(paused_ms / 1000)
        event = WeightsUpdated(served_model=model, version=self.version or previous, previous_version=previous,
                               weights_path=request.weights_path, status=status,
                               error=error if error is None else f"update to version {request.version}: {error}",
                               paused_ms=paused_ms, load_ms=load_ms, held_calls=self._held_this_update,
                               drained_calls=drained)
        try:
            await self.recorder.record(event)
        except ProxyError as exc:
            logger.error("weight update event (version %s, %s) not recorded: %s", request.version, status,
                         exc.message)
