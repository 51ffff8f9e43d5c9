"""One session's way through a gateway node: queued → init → ready → running → post_run → teardown → end.

Each stage is a bounded pool (``GatewaySettings``): ``init_workers`` runtime inits, ``run_slots`` harness
runs, ``post_workers`` patches and teardowns. A session holds one of ``run_slots + prewarm`` places from
the start of its init to the end of its run, so up to ``prewarm`` runtimes are initialized ahead of the
free run slots and wait in ``ready`` (pre-warm), and slow set-up stays off the critical path.

The session's timeout budget (``SessionSpec.timeout_s``) starts when its init starts, not when it was
dispatched: waiting in the queue costs nothing, waiting in ``ready`` does. A session that runs out of
budget in its run is killed and still goes through post-run, so it ends with its patch so far (the
trajectory worker builds a partial trajectory from the completions it made).

Every stage change is a ``SessionStageChanged`` (with the seconds spent in the stage before, and the
node); the end is one ``SessionEnded`` with status, cause, whose failure it was, reason, exit code,
evidence, patch and seconds per stage. Whose failure is decided by the cause alone, by the table in
schemas/attribution.py: each place below names the cause it saw (the harness install, the runtime's
init, the run slot, Kafka, the proxy, the engine's health, the harness's exit judged with the model calls
the proxy recorded for the session and the head of its stderr, the patch). A cancelled session has no
failure kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from aiokafka import TopicPartition

from producers.adapters.base import AdapterError, HarnessAdapter, HarnessContext, HarnessInvocation
from producers.gateway.settings import GatewaySettings
from producers.harness_install import HarnessInstallError
from producers.runtimes.base import CommandResult, Runtime, RuntimeHandle, RuntimeInitError
from schemas.attribution import Cause, Evidence, exit_signal, judge_exit, kind_of, stderr_head
from schemas.sessions import (
    FailureKind,
    SessionEnded,
    SessionSpec,
    SessionStage,
    SessionStageChanged,
    SessionStatus,
)
from schemas.transport.errors import TransportError

logger = logging.getLogger(__name__)

OUTPUT_TAIL = 4000
PROXY_WAIT_S = 15.0
"""How long a session's run waits for the proxy to know the session (its registry reads `sessions`)."""

Emit = Callable[[SessionStageChanged, bool], Awaitable[None]]
"""Send a stage event; with ``required`` a failure raises TransportError, otherwise it is logged."""
Claim = Callable[["SessionRun", SessionStageChanged], Awaitable[bool]]
"""Take the session for this node by sending its ``init`` event; False when the node may not run it."""
RuntimeFor = Callable[[str], Runtime]
AdapterFor = Callable[[str], HarnessAdapter]


class _Released(Exception):
    """The node let the session go before claiming it (revocation, drain)."""


@dataclass
class Outcome:
    """How the session is ending, filled in as it goes."""

    status: SessionStatus = SessionStatus.COMPLETED
    failure: FailureKind | None = None
    cause: Cause | None = None
    reason: str | None = None
    exit_code: int | None = None
    evidence: Evidence | None = None
    patch: str | None = None
    artifacts: dict[str, str] = field(default_factory=dict)

    def fail(self, status: SessionStatus, cause: Cause | None, reason: str, *, stage: SessionStage | None = None,
             evidence: Evidence | None = None) -> None:
        """End with ``status``; ``cause`` (None for a cancel) decides whose failure it is."""
        self.status, self.cause, self.reason = status, cause, reason
        self.failure = kind_of(cause) if cause is not None else None
        if evidence is not None:
            self.evidence = evidence
        elif cause is not None and self.evidence is None:
            self.evidence = Evidence(stage=stage.value if stage is not None else None, detail=reason[:1000])


@dataclass(eq=False)
class SessionRun:
    """A session this node holds: its spec, where it came from, where it is, and how to stop it."""

    spec: SessionSpec
    partition: TopicPartition
    offsets: list[tuple[TopicPartition, int]]
    stage: SessionStage = SessionStage.QUEUED
    accepted_at: float = field(default_factory=time.monotonic)
    stage_started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    claimed: bool = False
    released: bool = False
    harness_started: bool = False
    cancel_reason: str | None = None
    handle: RuntimeHandle | None = None
    deadline: float | None = None
    """Monotonic time the budget runs out (set when init starts)."""
    task: asyncio.Task[SessionEnded | None] | None = None
    _active: asyncio.Task[None] | None = None

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    def cancel(self, reason: str) -> bool:
        """Stop the session where it is; it still goes through post-run and ends as cancelled. False if it is
        past its run already (it ends on its own)."""
        if self.cancel_reason is not None or self.released:
            return self.cancel_reason is not None
        if self.stage in (SessionStage.POST_RUN, SessionStage.TEARDOWN):
            return False
        self.cancel_reason = reason
        if self._active is not None and not self._active.done():
            self._active.cancel()
        return True

    def release(self) -> bool:
        """Let an unclaimed session go without an end (another node will run it); False once claimed."""
        if self.claimed:
            return False
        self.released = True
        if self._active is not None and not self._active.done():
            self._active.cancel()
        return True

    def remaining_s(self) -> float:
        assert self.deadline is not None
        return max(0.0, self.deadline - time.monotonic())


class Pools:
    """The node's bounded pools (see the module docstring)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.staged = asyncio.Semaphore(settings.run_slots + settings.prewarm)
        self.init = asyncio.Semaphore(settings.init_workers)
        self.run = asyncio.Semaphore(settings.run_slots)
        self.post = asyncio.Semaphore(settings.post_workers)


class Pipeline:
    """Runs sessions through the stages; the node decides which sessions, and sends their ends."""

    def __init__(self, settings: GatewaySettings, *, emit: Emit, claim: Claim, runtime_for: RuntimeFor,
                 adapter_for: AdapterFor, http: httpx.AsyncClient) -> None:
        self.settings = settings
        self.pools = Pools(settings)
        self._emit = emit
        self._claim = claim
        self._runtime_for = runtime_for
        self._adapter_for = adapter_for
        self._http = http

    # -- stage bookkeeping ------------------------------------------------------------------------------
    def stage_event(self, session: SessionRun, stage: SessionStage, detail: str | None = None) -> SessionStageChanged:
        """The event for ``session`` entering ``stage`` now (nothing changes until :meth:`enter`)."""
        elapsed = None if stage is SessionStage.QUEUED else round(time.monotonic() - session.stage_started, 6)
        return SessionStageChanged(session_id=session.session_id, task_id=session.spec.task_id, stage=stage,
                                   node=self.settings.node_name, elapsed_s=elapsed, detail=detail)

    @staticmethod
    def entered(session: SessionRun, event: SessionStageChanged) -> None:
        """Book the stage change ``event`` describes on the session."""
        now = time.monotonic()
        if event.stage is not SessionStage.QUEUED:
            previous = session.stage.value
            session.timings[previous] = round(session.timings.get(previous, 0.0) + now - session.stage_started, 6)
        session.stage, session.stage_started = event.stage, now

    async def _enter(self, session: SessionRun, stage: SessionStage, *, required: bool = False,
                     detail: str | None = None) -> None:
        event = self.stage_event(session, stage, detail)
        self.entered(session, event)
        await self._emit(event, required)

    # -- the session ------------------------------------------------------------------------------------
    async def run(self, session: SessionRun) -> SessionEnded | None:
        """Take ``session`` from the queue to its end; None if it was released before it was claimed."""
        outcome = Outcome()
        session._active = asyncio.create_task(self._through_run(session, outcome),
                                              name=f"session-{session.session_id}")
        try:
            await session._active
        except _Released:
            return None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this task itself is being cancelled (the node stops hard): no end from here
            if session.released and not session.claimed:
                return None
            if session.cancel_reason is None:
                raise
            outcome.fail(SessionStatus.CANCELLED, None, session.cancel_reason)
        if session.handle is not None:
            await self._post_run(session, outcome)
        self.entered(session, self.stage_event(session, session.stage))  # close the last stage's timing
        timings = dict(session.timings)
        timings["total"] = round(time.monotonic() - session.accepted_at, 6)
        return SessionEnded(session_id=session.session_id, task_id=session.spec.task_id, status=outcome.status,
                            failure=outcome.failure, cause=outcome.cause, reason=outcome.reason,
                            exit_code=outcome.exit_code, evidence=outcome.evidence, patch=outcome.patch,
                            artifacts=outcome.artifacts, timings=timings)

    async def _through_run(self, session: SessionRun, outcome: Outcome) -> None:
        if session.cancel_reason is not None:  # cancelled before this task could be interrupted
            outcome.fail(SessionStatus.CANCELLED, None, session.cancel_reason)
            return
        async with self.pools.staged:
            if session.released or not await self._claim(session, self.stage_event(session, SessionStage.INIT)):
                session.released = True
                raise _Released
            session.deadline = time.monotonic() + session.spec.timeout_s
            invocation = await self._init(session, outcome)
            if invocation is None:
                return
            await self._enter(session, SessionStage.READY)
            try:
                async with asyncio.timeout(session.remaining_s()):
                    await self.pools.run.acquire()
            except TimeoutError:
                outcome.fail(SessionStatus.TIMEOUT, Cause.NO_RUN_SLOT,
                             f"no run slot free before the session's budget of {session.spec.timeout_s:g}s ran out",
                             stage=SessionStage.READY)
                return
            try:
                await self._run(session, invocation, outcome)
            finally:
                self.pools.run.release()

    async def _init(self, session: SessionRun, outcome: Outcome) -> HarnessInvocation | None:
        """Prepare the runtime and the harness's invocation; None (outcome set) when that failed."""
        spec = session.spec
        assert spec.agent is not None
        try:
            async with self.pools.init, asyncio.timeout(session.remaining_s()):
                runtime = self._runtime_for(spec.runtime.kind)
                adapter = self._adapter_for(spec.agent.harness)
                await asyncio.to_thread(adapter.executable)
                session.handle = await runtime.init(session.session_id, spec.runtime,
                                                    timeout_s=max(session.remaining_s(), 0.001))
                proxy = session.handle.proxy_url_for(self.settings.proxy_url).rstrip("/")
                base = f"{proxy}/s/{session.session_id}"
                context = HarnessContext(
                    session_id=session.session_id, instruction=spec.instruction or "", model=spec.agent.model,
                    api_key=spec.api_key or f"rollwire-{session.session_id}",
                    base_urls={"openai": f"{base}/v1", "anthropic": base, "gemini": base},
                    home=session.handle.home, workspace=session.handle.workspace,
                    settings=spec.agent.settings, command=spec.agent.command)
                invocation = adapter.invocation(context)
                if invocation.home_files:
                    await session.handle.write_home_files(invocation.home_files)
                return invocation
        except TimeoutError:
            outcome.fail(SessionStatus.TIMEOUT, Cause.RUNTIME_INIT,
                         f"runtime init ran past the session's budget of {spec.timeout_s:g}s", stage=SessionStage.INIT)
        except RuntimeInitError as exc:
            status = SessionStatus.TIMEOUT if session.remaining_s() <= 0 else SessionStatus.ERROR
            outcome.fail(status, Cause.RUNTIME_INIT, f"runtime init: {exc}", stage=SessionStage.INIT)
        except HarnessInstallError as exc:
            outcome.fail(SessionStatus.ERROR, Cause.HARNESS_INSTALL, f"harness install: {exc}",
                         stage=SessionStage.INIT)
        except AdapterError as exc:
            outcome.fail(SessionStatus.ERROR, Cause.AGENT_SPEC, f"agent spec refused: {exc}", stage=SessionStage.INIT)
        except Exception as exc:  # a runtime or adapter bug must still end the session
            logger.exception("session %s: init failed", session.session_id)
            outcome.fail(SessionStatus.ERROR, Cause.RUNTIME_INIT, f"runtime init failed: {exc!r}",
                         stage=SessionStage.INIT)
        return None

    async def _run(self, session: SessionRun, invocation: HarnessInvocation, outcome: Outcome) -> None:
        """Run the harness (the ``running`` event is on Kafka before it starts) and judge its exit."""
        assert session.handle is not None
        try:
            await self._enter(session, SessionStage.RUNNING, required=True)
        except TransportError as exc:
            outcome.fail(SessionStatus.ERROR, Cause.KAFKA, f"Kafka: {exc}", stage=SessionStage.RUNNING)
            return
        problem, _ = await self._proxy_state(session.spec, wait_s=min(PROXY_WAIT_S, session.remaining_s()))
        if problem is not None:
            outcome.fail(SessionStatus.ERROR, Cause.PROXY_UNREACHABLE, problem, stage=SessionStage.RUNNING)
            return
        engine = await self._engine_problem()
        if engine is not None:
            outcome.fail(SessionStatus.ERROR, Cause.ENGINE_UNAVAILABLE, f"before the harness started: {engine}",
                         stage=SessionStage.RUNNING)
            return
        session.harness_started = True
        try:
            result = await session.handle.run(invocation.argv, env=invocation.env, stdin=invocation.stdin,
                                              timeout_s=max(session.remaining_s(), 0.001))
        except (OSError, ValueError) as exc:
            outcome.fail(SessionStatus.ERROR, Cause.HARNESS_MISSING, f"harness could not start: {exc}",
                         stage=SessionStage.RUNNING)
            return
        await self._judge(session, result, outcome)

    async def _judge(self, session: SessionRun, result: CommandResult, outcome: Outcome) -> None:
        """The harness's exit, with the evidence around it, as a cause (schemas.attribution.judge_exit);
        an unreachable proxy or a down engine found after a failed run is the cause before the exit is."""
        outcome.exit_code = result.exit_code
        outcome.artifacts["harness_stdout_tail"] = result.stdout[-OUTPUT_TAIL:]
        outcome.artifacts["harness_stderr_tail"] = result.stderr[-OUTPUT_TAIL:]
        problem, calls = await self._proxy_state(session.spec, wait_s=0)
        evidence = Evidence(exit_code=result.exit_code, signal=exit_signal(result.exit_code),
                            timed_out=result.timed_out, stderr_head=stderr_head(result.stderr),
                            model_calls=calls, stage=SessionStage.RUNNING.value, oom_killed=result.oom_killed,
                            pids_limit_hit=result.pids_limit_hit)
        cause = judge_exit(result.exit_code, result.stderr, calls, timed_out=result.timed_out,
                           pids_limit_hit=bool(result.pids_limit_hit))
        if cause is None:
            return
        tail = (result.stderr or result.stdout)[-500:].strip()
        if result.timed_out:
            why = f"harness ran past the session's budget of {session.spec.timeout_s:g}s (from init)"
        else:
            why = f"harness exited {result.exit_code}: {tail}"
        if result.oom_killed:
            why = f"the sandbox's memory limit killed a process (OOM); {why}"
        elif result.pids_limit_hit:
            why = f"a fork was refused at the sandbox's pids limit; {why}"
        if problem is not None:
            cause, why = Cause.PROXY_UNREACHABLE, f"{problem} ({why})"
        elif not calls and (engine := await self._engine_problem()) is not None:
            cause, why = Cause.ENGINE_UNAVAILABLE, f"{engine} ({why})"
        evidence.detail = why[:1000]
        status = SessionStatus.TIMEOUT if result.timed_out else SessionStatus.ERROR
        outcome.fail(status, cause, why, evidence=evidence)

    async def _engine_problem(self) -> str | None:
        """None when no engine URL is configured or its ``/health`` answers 200; else what is wrong."""
        if not self.settings.engine_url:
            return None
        try:
            response = await self._http.get(f"{self.settings.engine_url}/health", timeout=5.0)
        except httpx.HTTPError as exc:
            return f"engine unreachable at {self.settings.engine_url}: {exc!r}"
        if response.status_code != 200:
            return f"engine at {self.settings.engine_url} answers /health with {response.status_code}"
        return None

    async def _proxy_state(self, spec: SessionSpec, *, wait_s: float) -> tuple[str | None, int | None]:
        """(None, model calls recorded) when the proxy answers and knows the session as live; else (what is
        wrong, None). Asked with the session's own key: the proxy tells a session's state to that session
        (or its operator) only."""
        url = f"{self.settings.proxy_url}/v1/sessions/{spec.session_id}"
        headers = {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        deadline = time.monotonic() + wait_s
        while True:
            try:
                response = await self._http.get(url, headers=headers, timeout=5.0)
            except httpx.HTTPError as exc:
                problem = f"proxy unreachable at {self.settings.proxy_url}: {exc!r}"
            else:
                if response.status_code == 200:
                    body = response.json()
                    calls = body.get("calls")
                    calls = calls if isinstance(calls, int) else None
                    return (None if body.get("live", True) else "the proxy says the session has ended"), calls
                problem = f"the proxy does not know the session ({response.status_code})"
            if time.monotonic() >= deadline:
                return problem, None
            await asyncio.sleep(0.2)

    async def _post_run(self, session: SessionRun, outcome: Outcome) -> None:
        """Take the patch (if the harness ran) and tear the runtime down, each in its own budget."""
        assert session.handle is not None
        async with self.pools.post:
            if session.harness_started:
                await self._enter(session, SessionStage.POST_RUN)
                await self._take_patch(session, outcome)
            await self._enter(session, SessionStage.TEARDOWN)
            try:
                await asyncio.wait_for(session.handle.teardown(), self.settings.teardown_timeout_s)
            except Exception:  # the session's result stands; the leftover is the runtime's to report
                logger.exception("session %s: teardown failed", session.session_id)

    async def _take_patch(self, session: SessionRun, outcome: Outcome) -> None:
        assert session.handle is not None
        try:
            patch = await asyncio.wait_for(session.handle.patch(), self.settings.post_timeout_s)
        except Exception as exc:
            why = f"bad patch: {exc!r}"
            if outcome.status is SessionStatus.COMPLETED:
                outcome.fail(SessionStatus.ERROR, Cause.BAD_PATCH, why, stage=SessionStage.POST_RUN)
            else:
                outcome.reason = f"{outcome.reason}; {why}"
            return
        size = len(patch.encode("utf-8"))
        if size > self.settings.max_patch_bytes:
            why = f"bad patch: {size} bytes, over the limit of {self.settings.max_patch_bytes}"
            if outcome.status is SessionStatus.COMPLETED:
                outcome.fail(SessionStatus.ERROR, Cause.BAD_PATCH, why, stage=SessionStage.POST_RUN)
            else:
                outcome.reason = f"{outcome.reason}; {why}"
            return
        outcome.patch = patch
