"""The policy the engine serves: its weight version, the gate that model calls pass, and weight updates.

Every model call passes :meth:`Policy.admit` before it reaches the engine and leaves once the engine is
done with it (:meth:`Admission.leave`). While the gate is open that costs a flag test and a counter; the
call runs under the version known then, which the proxy stamps on its completion event (the engine's
own ``weight_versions`` spans win on the token path, see :func:`sampled_version`).

A weight update (:meth:`Policy.update`, ``POST /v1/policy/weights``) closes the gate of every proxy process
of the tier (new calls wait: the harness sees a slower reply, never an error), waits for the calls in flight
on all of them to finish on the old weights, has the engines pause, load the checkpoint, take the new
version, drop their prefix caches and resume (:mod:`proxy.weight_api`), writes a
:class:`~schemas.policy.WeightsUpdated` event to the ``policy`` topic and reopens every gate. The process
that received the push coordinates; the tier agrees through the ``policy`` topic (:mod:`proxy.policy_tier`),
and a process alone in its tier does the same through it. Because nothing runs on the engines while they
change, a call's version is known exactly. One update at a time across the tier; versions only go up.

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
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from proxy.capture import Recorder
from proxy.errors import (
    CaptureFailed,
    CheckpointRefused,
    DrainTimeout,
    PolicyConflict,
    PolicyNotReady,
    ProxyError,
    WeightApiMissing,
    WeightUpdateFailed,
)
from proxy.metrics import ProxyMetrics
from proxy.fleet.weights import PoolWeights
from proxy.weight_api import tied_head_missing
from schemas.api import PolicyState, WeightUpdate
from schemas.policy import INITIAL_VERSION, ProxyDrain, WeightsUpdated, version_number

if TYPE_CHECKING:
    from proxy.policy_tier import PolicyTier

logger = logging.getLogger(__name__)

_ENGINE_INITIAL = ("", "default")  # what vLLM reports before its first update


def engine_version(reported: str | None) -> str:
    """The policy version of a version the engine reports: vLLM's ``"default"`` is the initial weights, 0."""
    if reported is None or reported.strip() in _ENGINE_INITIAL:
        return str(INITIAL_VERSION)
    return reported


def numbered_spans(spans: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Generate's ``weight_versions`` spans with each version as the policy numbers it (vLLM's initial
    ``"default"`` is 0), so that every reader of the event sees the version the proxy serves under."""
    if spans is None:
        return None
    return [{**span, "version": engine_version(str(span["version"]))}
            if isinstance(span, dict) and span.get("version") is not None else span for span in spans]


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

    def __init__(self, weights: PoolWeights, recorder: Recorder, metrics: ProxyMetrics,
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
        self.updating_to: str | None = None  # the version of the update this process coordinates
        self.following: str | None = None  # the version of the tier's update, when another process runs one
        self.tier: PolicyTier | None = None  # the other proxy processes, through the log (set by ProxyState.build)
        self.held = 0
        self.in_flight = 0
        self._known = False
        self._learning = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Event()  # set, then replaced, whenever the version changes
        self._idle: asyncio.Event | None = None  # set when the last call in flight leaves during a drain
        self._holds: set[str] = set()  # why the gate is closed: an update's id, or the process's start
        self._drained_at_close = 0
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
        if not self._open.is_set() or self.updating_to is not None:
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

    # -- the gate, for the tier -----------------------------------------------------------------------
    def hold(self, reason: str) -> None:
        """Close the gate for ``reason`` (an update's id, or this process's start): new calls wait until every
        reason is released."""
        if not self._holds:
            self._open.clear()
            self._drained_at_close = self.in_flight
            self._held_this_update = 0
        self._holds.add(reason)

    def release(self, reason: str) -> bool:
        """Release one reason the gate was closed for; it opens once none is left. Whether ``reason`` held it
        (releasing twice is fine)."""
        held = reason in self._holds
        self._holds.discard(reason)
        if not self._holds:
            self._open.set()
        return held

    async def drain_here(self, timeout_s: float, instance: str) -> ProxyDrain:
        """Wait for this process's calls in flight (its gate closed) to finish: its part of an update."""
        try:
            await self._drain(timeout_s)
        except DrainTimeout as exc:
            return ProxyDrain(instance=instance, status="drain_timeout", drained_calls=self._drained_at_close,
                              held_calls=self._held_this_update, error=exc.message)
        return ProxyDrain(instance=instance, drained_calls=self._drained_at_close, held_calls=self._held_this_update)

    def follow(self, version: str, weights_path: str | None) -> None:
        """Take the version (and, after a good update, the checkpoint) another process's update left the
        engines at, before this process's gate reopens: its calls then carry that version, and its pool brings
        an engine that rejoins to that checkpoint."""
        self._known = True
        self._set_version(version)
        if weights_path is not None:
            self.weights_path = weights_path
            self.weights.follow(weights_path, version)

    def start_tier(self) -> None:
        if self.tier is not None:
            self.tier.start()

    async def stop_tier(self) -> None:
        if self.tier is not None:
            await self.tier.stop()

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
        if self.updating_to is None and self.following is None:
            self._known = False
            await self.learn()

    def state(self, served_model: str | None) -> PolicyState:
        """What ``GET /v1/policy`` answers; :class:`WeightApiMissing` when the engine gives no version."""
        if self.version is None:
            raise WeightApiMissing("the engine reports no weight version (vLLM serves GET /weight_info only with "
                                   "VLLM_SERVER_DEV_MODE=1), so this proxy cannot track or update its policy")
        return PolicyState(served_model=served_model, version=self.version,
                           updating=self.updating_to is not None or self.following is not None,
                           holding=not self._open.is_set(), updates=self.updates, last_paused_ms=self.last_paused_ms,
                           held_calls=self.held, tier=self.tier.live() if self.tier is not None else [])

    # -- weight updates -------------------------------------------------------------------------------
    async def update(self, request: WeightUpdate) -> PolicyState:
        """Load ``request.weights_path`` into the engine as ``request.version`` (see the module docstring).

        Raises :class:`PolicyConflict` (another update runs, or the version is not newer), ProxyError on an
        engine that cannot be asked, :class:`DrainTimeout` and :class:`WeightUpdateFailed` (the gate reopened,
        a failed event written). Run it shielded: a caller that goes away must not leave the gate closed."""
        if self.updating_to is not None:
            raise PolicyConflict(f"a weight update to version {self.updating_to} is in progress; one at a time")
        if self.following is not None:
            running = self.tier.running() if self.tier is not None else None
            raise PolicyConflict(f"a weight update to version {self.following} is in progress (coordinated by "
                                 f"{running.coordinator if running else 'another proxy'}); one at a time")
        self.updating_to = request.version
        try:
            model = await self._update(request)
        finally:
            self.updating_to = None
            if self.tier is not None:
                self.tier.done()  # cancelled or not, this process's heartbeat names no update from now on
        return self.state(model)

    async def _update(self, request: WeightUpdate) -> str:
        """The update's steps; returns the served model's name."""
        tier = self.tier
        if tier is None:
            raise RuntimeError("a Policy updates weights through its PolicyTier (made by ProxyState.build)")
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
                    "closing the gates of the tier (%s) on %d calls in flight here", request.version,
                    (closed - began) * 1000, (asked_version - began) * 1000, (checked - asked_version) * 1000,
                    (closed - checked) * 1000, ", ".join(tier.live()), self.in_flight)
        update_id = uuid.uuid4().hex
        status: Literal["ok", "failed", "withdrawn"] = "withdrawn"
        parts: list[ProxyDrain] = []
        failure: ProxyError | None = None
        load_ms = 0.0
        try:
            update = await tier.begin(update_id, request, model)  # this gate closes at once, the others on the log
            status = "failed"
            parts = await tier.drains(update)
            late = [part for part in parts if part.status == "drain_timeout"]
            if late:
                raise DrainTimeout("; ".join(f"proxy {part.instance}: {part.error}" for part in late))
            load_ms = await self._swap(request, reported or previous)
            self._set_version(request.version)
            status = "ok"
        except ProxyError as exc:
            failure = exc
            if not isinstance(exc, (DrainTimeout, PolicyConflict, CaptureFailed)):
                await self.refresh_after_failure()
        finally:
            tier.finish_here(update_id)  # held calls go on, whatever happened (cancellation included)
        paused_ms = (time.perf_counter() - closed) * 1000
        if status == "ok":
            self.updates += 1
            self.last_paused_ms = paused_ms
        if status != "withdrawn":
            own = [part.model_copy(update={"held_calls": self._held_this_update}) if part.instance == tier.instance
                   else part for part in parts]
            await self._emit(model, request, previous, status, paused_ms, load_ms, update_id, tier.instance, own,
                             failure.message if failure is not None else None)
        await tier.tell(update_id, model, status, self.version or previous,
                        request.weights_path if status == "ok" else None,
                        failure.message if failure is not None else None)
        if failure is not None:
            raise failure
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
                    paused_ms: float, load_ms: float, update_id: str, coordinator: str, proxies: list[ProxyDrain],
                    error: str | None) -> None:
        """The update's event on the ``policy`` topic, and its metrics. A Kafka failure is logged: the
        engine has changed either way, and the answer must say so."""
        self.metrics.weight_updates.labels(status=status).inc()
        self.metrics.pause_seconds.observe(paused_ms / 1000)
        event = WeightsUpdated(served_model=model, version=self.version or previous, previous_version=previous,
                               weights_path=request.weights_path, status=status,
                               error=error if error is None else f"update to version {request.version}: {error}",
                               paused_ms=paused_ms, load_ms=load_ms,
                               held_calls=sum(part.held_calls for part in proxies),
                               drained_calls=sum(part.drained_calls for part in proxies), engines=self.weights.report(),
                               update_id=update_id, coordinator=coordinator, proxies=proxies)
        try:
            await self.recorder.record(event)
        except ProxyError as exc:
            logger.error("weight update event (version %s, %s) not recorded: %s", request.version, status,
                         exc.message)
