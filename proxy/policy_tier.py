"""Weight updates across the proxy tier: which proxy processes are live, and the gate each one closes.

Every proxy process in front of the engines holds its calls while the engines change, not only the one that
received the push. The processes agree through the ``policy`` topic, which each follows from a little before
it started (:class:`PolicyTier`), and on which each writes, keyed by the served model as the pushes are:

- :class:`~schemas.policy.ProxyAlive` every ``proxy_tier_heartbeat_s``: the process is live, and which update
  it coordinates, if any. One not heard from for its ``timeout_s`` (``proxy_tier_timeout_s``) is gone; one that
  stops says so (``leaving``).
- :class:`~schemas.policy.TierGate`, an update's three phases. ``close``: the coordinator (the process that
  received ``POST /v1/policy/weights``) begins; every process closes its gate and drains its calls in flight.
  ``drained``: each process's acknowledgement, with its counts. ``open``: the coordinator ends the update, once
  the engines resumed or it failed; every process reopens at the version the event names.

The topic has one partition, so the log orders the tier. A coordinator's close counts once it is read back: the
processes live then (its own included) are the ones it waits for; a close read while another update is open has
lost (its coordinator answers 409 and withdraws it), so two pushes to two processes at once run one at a time.
The coordinator waits for each acknowledgement up to the update's ``drain_timeout_s`` plus
``proxy_tier_timeout_s``, and for a process that goes silent meanwhile no longer than its timeout; the update
then goes on, and the event names each process that did not acknowledge (``absent``). A process whose drain
timed out fails the update, as one process's does.

A process reopens on its own, with a warning that says why, when the update's coordinator is not heard from for
its timeout, when the coordinator's heartbeat says it no longer runs the update (its open was lost), or after
the close's ``hold_limit_s``. The engines may then still be paused or half-loaded: a new update from any process
brings them to one version again. A process that starts keeps its gate closed until it has read the recent log
(at most ``proxy_tier_timeout_s``), so one that starts during an update holds its calls until that update ends.

A push needs the log: when its close cannot be written or read back, it is refused (503) and nothing changes,
since the other processes could not be told. One process alone runs the same protocol, with itself as its tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

from proxy.capture import Recorder
from proxy.errors import CaptureFailed, PolicyConflict, ProxyError
from proxy.settings import ProxySettings
from schemas.api import WeightUpdate
from schemas.policy import ProxyAlive, ProxyDrain, TierGate
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings, Received
from schemas.transport.errors import TransportError

logger = logging.getLogger(__name__)

START = "start"
"""The gate's hold while a starting process reads the recent log."""
_CLOCK_MARGIN_S = 60.0  # read back this much further, for the clocks of other hosts
_TICK_S = 0.2
_ENDED_KEPT = 256


class Gate(Protocol):
    """What the tier needs of this process's policy (:class:`proxy.policy.Policy`): its gate, its drain, the
    version it stamps on calls."""

    following: str | None
    served_model: Callable[[], Awaitable[str]]

    def hold(self, reason: str) -> None: ...

    def release(self, reason: str) -> bool: ...

    async def drain_here(self, timeout_s: float, instance: str) -> ProxyDrain: ...

    def follow(self, version: str, weights_path: str | None) -> None: ...

    async def refresh_after_failure(self) -> None: ...


@dataclass
class Member:
    """A proxy process of the tier as this one last heard of it."""

    seen: float  # monotonic: when its last heartbeat was written, as near as this process can tell
    timeout_s: float
    updating: str | None
    said_at: datetime  # its last heartbeat's occurred_at (its own clock)

    def silent_s(self) -> float:
        return time.monotonic() - self.seen


@dataclass
class TierUpdate:
    """A weight update the tier is in, as this process follows it."""

    update_id: str
    coordinator: str
    version: str | None
    since: float  # monotonic: when its close was written, as near as this process can tell
    hold_limit_s: float
    closed_at: datetime | None  # its close's occurred_at; None when learned from its coordinator's heartbeat
    expected: frozenset[str] = frozenset()  # the processes live when its close was read
    drains: dict[str, ProxyDrain] = field(default_factory=dict)
    drain_timeout_s: float | None = None


class PolicyTier:
    """This process's part in the tier's weight updates (see the module docstring): it follows the ``policy``
    topic, says it is live, closes, drains and reopens this process's gate, and coordinates this process's
    updates (:meth:`begin`, :meth:`drains`, :meth:`finish_here`, :meth:`tell`, :meth:`done`, called by
    :meth:`proxy.policy.Policy.update`)."""

    def __init__(self, settings: ProxySettings, kafka: KafkaSettings, recorder: Recorder, policy: Gate) -> None:
        if settings.proxy_tier_timeout_s <= settings.proxy_tier_heartbeat_s:
            raise ValueError(f"ROLLWIRE_PROXY_TIER_TIMEOUT_S ({settings.proxy_tier_timeout_s:g}) must be longer than "
                             f"ROLLWIRE_PROXY_TIER_HEARTBEAT_S ({settings.proxy_tier_heartbeat_s:g}): a live process "
                             "would be taken for gone between two heartbeats")
        self.instance = settings.instance
        self.kafka = kafka
        self.recorder = recorder
        self.policy = policy
        self.heartbeat_s = settings.proxy_tier_heartbeat_s
        self.timeout_s = settings.proxy_tier_timeout_s
        self.weight_update_timeout_s = settings.weight_update_timeout_s
        self.model: str | None = None  # the served model: the key of the tier's events, and which ones are ours
        self.members: dict[str, Member] = {}
        self.current: TierUpdate | None = None
        self.coordinating: str | None = None  # the update this process coordinates (on its heartbeats)
        self.caught_up = asyncio.Event()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._mine: dict[str, asyncio.Future[TierUpdate]] = {}  # own closes not yet read back
        self._closed_written: set[str] = set()
        self._changed = asyncio.Event()
        self._position: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()  # drains and reopens under way
        policy.hold(START)  # until the recent log is read

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name="rollwire-policy-tier"),
                       asyncio.create_task(self._open_after_start(), name="rollwire-policy-tier-start")]

    async def stop(self) -> None:
        """Say this process leaves (no update waits for it), then stop following; safe to call twice."""
        tasks, self._tasks = [*self._tasks, *self._background], []
        if tasks and self.model is not None:
            with contextlib.suppress(TimeoutError, ProxyError):
                async with asyncio.timeout(min(self.recorder.timeout_s, 5.0)):
                    await self._say(leaving=True)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _open_after_start(self) -> None:
        """A process that cannot read the log (Kafka down) serves anyway after the tier's timeout."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.caught_up.wait(), self.timeout_s)
            return
        if self.policy.release(START):
            logger.warning("the policy topic was not read within %.0f s of starting (Kafka?): serving calls "
                           "without knowing whether another proxy process runs a weight update", self.timeout_s)

    async def _run(self) -> None:
        while self.model is None:
            try:
                self.model = await self.policy.served_model()
            except ProxyError as exc:
                # No engine answers, so no call can be served either: nothing to hold. Once one names the
                # model, the gate waits again for the log (an update may be running).
                if not self.caught_up.is_set() and self.policy.release(START):
                    logger.warning("the proxy tier waits for an engine to name the served model (%s); calls are "
                                   "not held meanwhile", exc.message)
                await asyncio.sleep(1.0)
        if not self.caught_up.is_set():
            self.policy.hold(START)
        beating = asyncio.create_task(self._beat(), name="rollwire-policy-tier-heartbeat")
        try:
            while True:
                try:
                    await self._follow()
                except TransportError as exc:
                    logger.warning("the proxy tier lost the policy topic (%s); reading again in 2 s", exc)
                    await asyncio.sleep(2)
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating

    async def _beat(self) -> None:
        failing = False
        while True:
            try:
                await self._say(leaving=False)
            except ProxyError as exc:
                if not failing:
                    logger.warning("this proxy's heartbeat is not written (%s): the tier's weight updates stop "
                                   "waiting for it after %g s", exc.message, self.timeout_s)
                failing = True
            else:
                if failing:
                    logger.info("this proxy's heartbeat is written again")
                failing = False
            await asyncio.sleep(self.heartbeat_s)

    async def _say(self, *, leaving: bool) -> None:
        assert self.model is not None
        await self.recorder.record(ProxyAlive(served_model=self.model, instance=self.instance,
                                              timeout_s=self.timeout_s, updating=self.coordinating, leaving=leaving))

    # -- following the log ------------------------------------------------------------------------------
    async def _follow(self) -> None:
        async with EventConsumer(self.kafka, [Topic.POLICY], group_id=None, service="proxy-tier",
                                 dead_letters=False, dedupe_window=10_000) as consumer:
            partitions = await consumer.wait_for_assignment()
            if self._position is not None:
                consumer.seek(partitions[0], self._position)
            else:
                lookback_s = 2 * self.timeout_s + _CLOCK_MARGIN_S
                await consumer.seek_to_time(int((time.time() - lookback_s) * 1000), partitions)
            ends = await consumer.end_offsets(partitions)
            while True:
                for received in await consumer.getmany(timeout_ms=int(_TICK_S * 1000)):
                    self._apply(received)
                    self._position = received.offset + 1
                if not self.caught_up.is_set() and await consumer.caught_up(ends):
                    self.caught_up.set()
                    self.policy.release(START)
                if self.caught_up.is_set():
                    self._watch()

    def _apply(self, received: Received) -> None:
        event = received.event
        if getattr(event, "served_model", None) != self.model:
            return
        # Before the log is caught up, what is read is history: its age counts toward timeouts.
        age_s = 0.0 if self.caught_up.is_set() else max(0.0, time.time() - received.timestamp_ms / 1000)
        if isinstance(event, ProxyAlive):
            self._heard(event, age_s)
        elif isinstance(event, TierGate):
            if event.phase == "close":
                self._closed(event, age_s)
            elif event.phase == "drained":
                self._drained(event)
            else:
                self._opened(event)
        self._notify()

    def _heard(self, alive: ProxyAlive, age_s: float) -> None:
        if alive.leaving:
            self.members.pop(alive.instance, None)
            return
        self.members[alive.instance] = Member(time.monotonic() - age_s, alive.timeout_s, alive.updating,
                                              alive.occurred_at)
        update = self.current
        if (update is None and alive.updating is not None and alive.updating not in self._ended
                and alive.updating not in self._mine and alive.instance != self.instance):
            # An update whose close this process did not read (it started after it): its coordinator says it runs.
            self._follow_update(TierUpdate(alive.updating, alive.instance, None, time.monotonic() - age_s,
                                           self._hold_limit(None), None))

    def _closed(self, close: TierGate, age_s: float) -> None:
        update = self.current
        if close.update_id in self._ended or (update is not None and update.update_id == close.update_id
                                              and update.closed_at is not None):
            return
        if update is not None and update.update_id != close.update_id:
            # Another update is open: this close lost; its coordinator withdraws it.
            waiting = self._mine.get(close.update_id)
            if waiting is not None and not waiting.done():
                waiting.set_exception(PolicyConflict(
                    f"a weight update to version {update.version or '?'} is in progress (coordinated by "
                    f"{update.coordinator}); one at a time"))
            return
        if update is None:
            update = TierUpdate(close.update_id, close.coordinator, close.version, time.monotonic() - age_s,
                                close.hold_limit_s or self._hold_limit(close.drain_timeout_s), close.occurred_at)
            self._follow_update(update)
        update.version, update.closed_at = close.version, close.occurred_at
        update.drain_timeout_s = close.drain_timeout_s
        update.expected = frozenset({*self._live(), close.coordinator})
        self.policy.following = close.version
        self._spawn(self._drain_and_say(update))
        waiting = self._mine.get(close.update_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(update)

    def _follow_update(self, update: TierUpdate) -> None:
        self.current = update
        self.policy.following = update.version or "?"
        self.policy.hold(update.update_id)

    def _drained(self, ack: TierGate) -> None:
        update = self.current
        if update is not None and update.update_id == ack.update_id and ack.drain is not None:
            update.drains.setdefault(ack.drain.instance, ack.drain)

    def _opened(self, opened: TierGate) -> None:
        update = self.current
        if update is None or update.update_id != opened.update_id:
            self._end(opened.update_id)
            return
        self._end(update.update_id)
        if opened.status == "ok" and opened.version is not None:
            self.policy.follow(opened.version, opened.weights_path)
        elif opened.version is not None:
            self.policy.follow(opened.version, None)
        self.policy.release(update.update_id)

    def _end(self, update_id: str) -> None:
        self._ended[update_id] = None
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        if self.current is not None and self.current.update_id == update_id:
            self.current = None
            self.policy.following = None

    def _watch(self) -> None:
        """Reopen when the update this process follows lost its coordinator (see the module docstring)."""
        update = self.current
        if update is None or update.update_id == self.coordinating:
            return
        coordinator = self.members.get(update.coordinator)
        silent_s = coordinator.silent_s() if coordinator is not None else time.monotonic() - update.since
        reason = None
        if update.coordinator == self.instance:
            reason = "this process is its coordinator and runs no such update (it was started again)"
        elif silent_s > (coordinator.timeout_s if coordinator is not None else self.timeout_s):
            reason = f"its coordinator {update.coordinator} has not been heard from for {silent_s:.1f} s"
        elif (coordinator is not None and coordinator.updating != update.update_id
              and (update.closed_at is None or coordinator.said_at > update.closed_at)):
            reason = f"its coordinator {update.coordinator} says it no longer runs it (its open was lost)"
        elif time.monotonic() - update.since > update.hold_limit_s:
            reason = f"it has held the gate for longer than its limit ({update.hold_limit_s:.0f} s)"
        if reason is None:
            return
        logger.warning("weight update %s to version %s: reopening this proxy's gate without the update's end, "
                       "because %s. The engines may still be paused or half-loaded: a new update (POST "
                       "/v1/policy/weights to any proxy) brings every engine to one version again",
                       update.update_id, update.version or "?", reason)
        self._end(update.update_id)
        self._spawn(self._reopen_unsure(update.update_id))

    async def _reopen_unsure(self, update_id: str) -> None:
        """Reopen after an update whose end was not read: at the version the engines report now."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self.policy.refresh_after_failure()
        self.policy.release(update_id)

    async def _drain_and_say(self, update: TierUpdate) -> None:
        """Drain this process's calls in flight, and write its acknowledgement while the update is open."""
        await self.caught_up.wait()  # a close read as history whose open follows needs no answer
        if self.current is not update:
            return
        drain = await self.policy.drain_here(update.drain_timeout_s or 600.0, self.instance)
        if self.current is not update:
            return
        update.drains.setdefault(self.instance, drain)  # the coordinator's own, without the log's round trip
        self._notify()
        assert self.model is not None
        try:
            await self.recorder.record(TierGate(served_model=self.model, update_id=update.update_id,
                                                coordinator=update.coordinator, instance=self.instance,
                                                phase="drained", drain=drain))
        except ProxyError as exc:
            logger.error("weight update %s: this proxy's acknowledgement was not written (%s); the coordinator "
                         "goes on without it after its wait", update.update_id, exc.message)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- membership -------------------------------------------------------------------------------------
    def _live(self) -> set[str]:
        return {name for name, member in self.members.items() if member.silent_s() <= member.timeout_s}

    def live(self) -> list[str]:
        """The tier's processes this one hears from, itself included."""
        return sorted(self._live() | {self.instance})

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _hold_limit(self, drain_timeout_s: float | None) -> float:
        """The longest a process holds its gate for one update (drain, acknowledgements, pause and load)."""
        return (drain_timeout_s or 600.0) + self.timeout_s + 2 * self.weight_update_timeout_s

    # -- coordinating -------------------------------------------------------------------------------------
    async def begin(self, update_id: str, request: WeightUpdate, model: str) -> TierUpdate:
        """Close this process's gate, write the update's close and wait until it is read back: the update then
        runs. :class:`PolicyConflict` when another update's close came first; CaptureFailed when the close
        cannot be written or read back. Whatever happens, :meth:`finish_here`, :meth:`tell` and :meth:`done` end it."""
        self.coordinating = update_id
        waiting = self._mine[update_id] = asyncio.get_running_loop().create_future()
        self.policy.hold(update_id)
        close = TierGate(served_model=model, update_id=update_id, coordinator=self.instance, instance=self.instance,
                         phase="close", version=request.version, weights_path=request.weights_path,
                         drain_timeout_s=request.drain_timeout_s, hold_limit_s=self._hold_limit(request.drain_timeout_s))
        try:
            await self.recorder.record(close)
            self._closed_written.add(update_id)
            async with asyncio.timeout(self.recorder.timeout_s + self.timeout_s):
                return await waiting
        except TimeoutError as exc:
            raise CaptureFailed(f"the update's close was written to the policy topic but not read back within "
                                f"{self.recorder.timeout_s + self.timeout_s:g} s, so the proxy tier cannot be "
                                "told; nothing was changed") from exc
        except CaptureFailed as exc:
            raise CaptureFailed(f"the proxy tier cannot be told of the update ({exc.message}); nothing was "
                                "changed") from exc
        finally:
            self._mine.pop(update_id, None)

    async def drains(self, update: TierUpdate) -> list[ProxyDrain]:
        """Each expected process's acknowledgement, waited for up to the update's drain timeout plus the tier's
        timeout (a process that goes silent: up to its own timeout); the missing ones as ``absent``."""
        deadline = time.monotonic() + (update.drain_timeout_s or 600.0) + self.timeout_s
        while True:
            missing = update.expected - update.drains.keys()
            waited_for = missing & (self._live() | {self.instance})
            if not waited_for or time.monotonic() >= deadline:
                break
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(_TICK_S * 2, max(0.0, deadline - time.monotonic())))
        parts = [update.drains[name] for name in sorted(update.expected) if name in update.drains]
        for name in sorted(update.expected - update.drains.keys()):
            parts.append(ProxyDrain(instance=name, status="absent", error=self._why_absent(name)))
            logger.warning("weight update %s goes on without proxy %s: %s", update.update_id, name,
                           parts[-1].error)
        return parts

    def _why_absent(self, name: str) -> str:
        member = self.members.get(name)
        if member is None:
            return "it left the tier (stopped) before it acknowledged"
        if member.silent_s() > member.timeout_s:
            return f"not heard from for {member.silent_s():.1f} s (its timeout is {member.timeout_s:g} s): gone"
        return "live, but no acknowledgement came within the update's drain timeout and the tier's timeout"

    def finish_here(self, update_id: str) -> None:
        """End this process's update here: its gate's hold released at once (the tier is told by :meth:`tell`)."""
        self._end(update_id)
        self.policy.release(update_id)

    async def tell(self, update_id: str, model: str, status: Literal["ok", "failed", "withdrawn"],
                   version: str | None, weights_path: str | None, error: str | None) -> None:
        """Write the update's open, when its close was written. Never raises: a tier that is not told reopens by
        itself (see the module docstring)."""
        try:
            if update_id in self._closed_written:
                await self.recorder.record(TierGate(served_model=model, update_id=update_id, coordinator=self.instance,
                                                    instance=self.instance, phase="open", version=version,
                                                    weights_path=weights_path, status=status, error=error))
        except ProxyError as exc:
            logger.error("weight update %s (%s): its open was not written (%s); the other proxy processes reopen "
                         "when this one's heartbeat says it runs no update", update_id, status, exc.message)
        finally:
            self._closed_written.discard(update_id)

    def done(self) -> None:
        """This process coordinates no update any more: its heartbeats say so, after the open (when :meth:`tell`
        ran), so that the others reopen on them if the open was lost."""
        self.coordinating = None

    def running(self) -> TierUpdate | None:
        """The update the tier is in now, as far as this process has read."""
        return self.current

