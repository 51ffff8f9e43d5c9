"""Serving one model call, whatever the provider API: engine, capture, and the reply held until recorded.

A provider module parses and normalizes the request and supplies a :class:`Renderer`; this module does
the rest. Whole replies are returned only after the completion event is acknowledged. Streams are
relayed as the engine produces them, but their closing part (finish reason, usage, end marker) is sent
only once the event is acknowledged; if capture fails the stream ends with an error instead, so the
harness retries rather than keeping unrecorded tokens. A failed call is recorded too, with its reason,
exactly once (:meth:`CallService.record_failure`; the HTTP layer uses it for calls refused before they
reach the engine).

Every call passes the policy gate (:meth:`proxy.policy.Policy.admit`) before its first engine request and
leaves it when the engine is done with it, so that a weight update can hold new calls and drain running
ones; the event carries the policy version the call was sampled under.

Prompt deltas (:mod:`schemas.prompt_chain`): the event of a call that continues its branch exactly
(``continuation.mode`` exact, the branch's last event known) is written as a delta against that event;
every other call's event is a keyframe (a branch's first call, a rendered call, a failed call, every
:data:`~schemas.prompt_chain.KEYFRAME_EVERY`-th event of a chain, a prompt grown past
:data:`~schemas.prompt_chain.KEYFRAME_GROWTH` times its chain's keyframe, a delta that would not be smaller),
except that a keyframe over the record limit is written as the delta it could be (:mod:`proxy.capture`).
The branch remembers the event only once the broker has it, so a failed or unrecorded call never becomes
a parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from proxy.continuation.branches import Placement, branch_id_for
from proxy.continuation.restore import BranchRestorer
from proxy.capture import CallContext, Recorder, completion_event
from proxy.continuation.exact import CannotContinue
from proxy.deferred import DeferredWork
from proxy.engine import effective_request, engine_body, fit_max_tokens
from proxy.fleet.pool import Engine, EnginePool
from proxy.turns import EngineDelta, EngineTurn, TurnAssembler
from proxy.errors import (
    CaptureFailed,
    ClientDisconnected,
    ContextOverflow,
    EngineConnectionLost,
    EngineFailed,
    EngineUnavailable,
    ProxyError,
    ProxyStopped,
    UnrecordableEvent,
    as_proxy_error,
)
from proxy.hangups import Hangup
from proxy.metrics import ProxyMetrics
from proxy.policy import Admission, Policy, floor_of, numbered_spans, sampled_version
from proxy.apis.base import Renderer
from proxy.relay import ClosingChunk
from proxy.session_registry import LiveSession
from proxy.tier.claims import CallNumbers
from proxy.continuation.token_api import TokenApi, TokenApiMissing
from schemas.completions import ChatMessage, Completion, Continuation, NormalizedRequest, Restore
from schemas.envelope import utcnow
from schemas.prompt_chain import KEYFRAME_EVERY, KEYFRAME_GROWTH, ChainLink, delta_against, next_link

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CallService:
    """Runs calls against the engine and records them: every call that reaches it leaves one event."""

    def __init__(self, pool: EnginePool, recorder: Recorder, metrics: ProxyMetrics, policy: Policy,
                 numbers: CallNumbers, restorer: BranchRestorer, *, upstream_stream: bool = True) -> None:
        self.pool = pool
        self.policy = policy
        self.recorder = recorder
        self.metrics = metrics
        self.numbers = numbers
        self.restorer = restorer
        self.upstream_stream = upstream_stream
        self._background: set[asyncio.Task[Any]] = set()
        # Work a stream's turn needs before it is recorded but not before its next byte (its prompt ids).
        self._deferred = DeferredWork()
        self._in_flight = 0  # calls inside whole() or stream()
        self._stopping = False

    def begin_stop(self) -> None:
        """The proxy is shutting down: a call cut from now on is recorded as ``proxy_stopped``, not as the
        harness's hang-up."""
        self._stopping = True

    async def drain(self, timeout_s: float) -> int:
        """Wait (up to ``timeout_s``) until no call is in flight and every detached recording is done, so
        that the calls a shutdown cut are on the log before the producer closes. Returns how many calls
        and recordings were still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        while self._in_flight or self._background:
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        left = self._in_flight + len(self._background)
        if left:
            logger.warning("%d calls or recordings still running after %.1f s of shutdown", left, timeout_s)
        return left

    def _cut(self, message: str) -> ProxyError:
        """What a cancelled call is recorded as: the proxy's own shutdown, or the harness gone away."""
        if self._stopping:
            return ProxyStopped("the proxy stopped before the call ended")
        return ClientDisconnected(message)

    async def record_failure(self, ctx: CallContext, request: NormalizedRequest, error: ProxyError,
                             turn: EngineTurn | None = None) -> None:
        """Record a failed call once (``error.recorded``). Best effort: a Kafka outage must not mask the
        original error, which the caller answers with."""
        if error.recorded:
            return
        error.recorded = True
        self.metrics.error(ctx.api, error.kind)
        if isinstance(error, CaptureFailed):
            return
        try:
            await ctx.numbered()
        except CaptureFailed as exc:
            logger.warning("failed call %s not recorded: it has no number (%s)", ctx.label, exc.message)
            return
        try:
            await self.recorder.record_completion(completion_event(ctx, request, turn, error))
        except UnrecordableEvent as exc:
            if not exc.recorded:
                logger.warning("failed call %s/%d not recorded: %s", ctx.session_id, ctx.sequence, exc.message)
                return
            # recorded slimmed (request dropped); the caller still answers with the call's own error
        except CaptureFailed as exc:
            logger.warning("failed call %s/%d not recorded: %s", ctx.session_id, ctx.sequence, exc.message)
            return
        self.metrics.event("error")

    async def _record_turn(self, ctx: CallContext, request: NormalizedRequest, turn: EngineTurn,
                           parent: ChainLink | None = None) -> ChainLink:
        """Record a served call (as a delta against ``parent`` where that is smaller) and return its link,
        the parent of its branch's next call."""
        _check_turn(turn)
        started = time.perf_counter()
        full = completion_event(ctx, request, turn)
        written = full if parent is None else \
            delta_against(full, parent, keyframe_every=KEYFRAME_EVERY, keyframe_growth=KEYFRAME_GROWTH)
        def smaller() -> Completion | None:  # a keyframe over the record limit: the call as a delta, if any
            assert parent is not None
            forced = delta_against(full, parent, keyframe_every=sys.maxsize, keyframe_growth=math.inf)
            return forced if forced is not full else None

        keyframe_with_parent = parent is not None and written is full
        written = await self.recorder.record_completion(written, smaller if keyframe_with_parent else None)
        ctx.stages.capture = time.perf_counter() - started
        return next_link(full, written, parent)

    async def _record_shielded(self, ctx: CallContext, request: NormalizedRequest, turn: EngineTurn,
                               parent: ChainLink | None = None) -> ChainLink:
        """Record a served call whatever the caller does from now on: shielded, so that a hang-up during
        the write neither cancels it nor gets the call recorded a second time (as abandoned)."""
        recording = asyncio.ensure_future(self._record_turn(ctx, request, turn, parent))
        self._background.add(recording)
        recording.add_done_callback(self._background.discard)
        recording.add_done_callback(retrieved)
        return await asyncio.shield(recording)

    async def _admit(self, ctx: CallContext, session: LiveSession) -> Admission:
        """Pass the policy gate (held while a weight update runs, or until the engine serves the session's
        floor); the call runs under the version known now."""
        admission = await self.policy.admit(floor_of(session.spec.policy_version))
        ctx.policy_version = admission.version
        return admission

    async def _prepare(self, request: NormalizedRequest, stream: bool) -> tuple[NormalizedRequest, dict, str]:
        """The request as it will be sent (fitted to the engine), its engine body, and the served model."""
        engine = (await self.pool.serving()).client  # one pool serves one model, with one context length
        model = await engine.served_model()
        request = fit_max_tokens(request, engine.max_model_len)
        return request, engine_body(request, model, stream=stream), model

    async def whole(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                    hangup: Hangup | None = None) -> EngineTurn:
        """Call the engine, record the event, and return the turn (see :meth:`_whole`)."""
        self._in_flight += 1
        try:
            return await self._whole(ctx, session, request, hangup)
        finally:
            self._in_flight -= 1

    async def _whole(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                     hangup: Hangup | None = None) -> EngineTurn:
        """Call the engine, record the event, and return the turn (raises ProxyError, already recorded).

        In a session's ``exact`` mode (the default) the prompt is built by the proxy from the session's
        branches (:mod:`proxy.continuation.exact`) and sent as token ids; otherwise, or when the engine has no
        token endpoints, the engine's chat endpoint renders it. With ``hangup``, a client that goes away
        while the call waits for the policy gate or the engine ends the call there (ClientDisconnected,
        recorded as such); once the engine has answered, the turn is recorded whatever the client does."""
        harness_request = request
        request = effective_request(request, session.spec.engine)
        turn: EngineTurn | None = None
        admission: Admission | None = None
        link: ChainLink | None = None
        try:
            await self.recorder.ensure_ready()
            admission = await _unless_gone(hangup, self._admit(ctx, session), "the policy gate")
            request, body, ctx.served_model = await self._prepare(request, stream=False)
            ctx.upstream_started_at = utcnow()
            ctx.stages.upstream_starts()
            placement = await self._place(ctx, session, request, harness_request)
            served, placement = await _unless_gone(
                hangup, self._served_on_pool(ctx, session, request, harness_request, placement, body), "the engine")
            turn = served
            admission.leave()  # the engine is done: recording must not hold up a weight update's drain
            ctx.first_token_at = utcnow()
            ctx.stages.first_bytes()
            link = await self._record_shielded(ctx, request, served, _delta_parent(placement, ctx.continuation))
        except asyncio.CancelledError:
            if turn is None:
                # Cancelled while it waited: the harness hung up before an exact call's stream had its first
                # bytes (that stream is this call, see _synthetic_stream), or the server is stopping.
                gone = self._cut("the client went away before the engine answered")
                self._detach(self.record_failure(ctx, request, gone, None))
            raise
        except Exception as exc:
            if admission is not None:
                admission.leave()
            error = as_proxy_error(exc, f"call {ctx.label}")
            await self.record_failure(ctx, request, error, turn)
            raise error from exc
        finally:
            if admission is not None:
                admission.leave()  # cancelled
        _remember(session, placement, request, ctx.sequence, served, harness_request, link, ctx.engine)
        self.metrics.event("ok")
        self.metrics.continuation(ctx.api, ctx.continuation)
        return served

    async def _place(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                     harness_request: NormalizedRequest) -> Placement:
        """Where the call goes among the session's branches, once they hold every earlier call of the session
        that another process served (read back from the log, once per call: a synthesized stream places the
        call it serves whole again). When the log cannot be read in time the branches may be behind it: the
        call is rendered whole, and its event says why.

        A call whose number is not in yet, in a session with no other process's calls unaccounted for, is
        placed on the branches as they are, and goes to the engine while its claim comes back
        (:meth:`_confirmed` settles it before anything reaches the harness); a session that is already
        behind the log waits for the number and is read back first."""
        claims = self.numbers.of(session.session_id)
        if not ctx.caught_up and not ctx.numbered_now() and self.restorer.behind(session, claims, sys.maxsize):
            await ctx.numbered()
        if not ctx.caught_up and ctx.numbered_now():
            await self._catch_up(ctx, session)
        placement = session.branches.place(request, harness_request)
        if ctx.restore_failed is not None:
            role = placement.branch.role if placement.branch is not None else placement.role
            return Placement("open", None, list(request.messages), opened=ctx.restore_failed, role=role)
        return placement

    async def _catch_up(self, ctx: CallContext, session: LiveSession) -> bool:
        """Bring the session's branches up to the log for every call numbered before this one (once per
        call); True when that changed them (events replayed) or left them possibly behind (the read failed)."""
        ctx.caught_up = True
        outcome = await self.restorer.catch_up(session, self.numbers.of(session.session_id), ctx.sequence)
        if outcome is None:
            return False
        self.metrics.restored(outcome.seconds, outcome.bytes_read, outcome.failed)
        ctx.restore = Restore(ms=outcome.seconds * 1000, bytes_read=outcome.bytes_read,
                              records_read=outcome.records_read, replayed=outcome.replayed)
        ctx.restore_failed = outcome.failed
        return outcome.replayed > 0 or outcome.failed is not None

    async def _confirmed(self, ctx: CallContext, session: LiveSession) -> bool:
        """For a call placed before its number was in: wait for the number, then bring the branches up to the
        log for the calls numbered before it. True when the placement stands (nothing came in that changes
        the branches); False when the call must be placed again (the engine request made so far is dropped).
        Raises the claim's CaptureFailed."""
        if ctx.caught_up:
            return True
        waiting = time.perf_counter()
        await ctx.numbered()
        self.metrics.call_number_waits.observe(time.perf_counter() - waiting)
        if await self._catch_up(ctx, session):
            self.metrics.calls_placed_again.inc()
            logger.info("call %s: placed again, its session's log held calls served elsewhere", ctx.label)
            return False
        return True

    async def _served_on_pool(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                              harness_request: NormalizedRequest, placement: Placement,
                              body: dict[str, Any]) -> tuple[EngineTurn, Placement]:
        """:meth:`_on_pool` from ``placement``. A placement made before the call's number was in runs while
        the number comes back; when it proves stale the run is cancelled and the call placed and run again."""
        if ctx.caught_up:
            return await self._on_pool(ctx, session, request, placement, body)
        attempt = asyncio.ensure_future(self._on_pool(ctx, session, request, placement, body))
        try:
            confirmed = await self._confirmed(ctx, session)
        except BaseException:
            await _cancelled(attempt)
            raise
        if confirmed:
            return await attempt
        await _cancelled(attempt)
        placement = await self._place(ctx, session, request, harness_request)
        return await self._on_pool(ctx, session, request, placement, body)

    async def _on_pool(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                       placement: Placement, body: dict[str, Any]) -> tuple[EngineTurn, Placement]:
        """The call on an engine of the pool: its branch's engine while that one serves (its prefix is cached
        there), else the least-loaded. An engine that cannot be reached, or whose connection breaks before
        the turn is whole, is taken out of rotation and the call goes to the next one: the harness has seen
        nothing yet, so it is still one call and one event (``engine_attempts`` says how many were tried)."""
        tried: set[str] = set()
        pinned = placement.branch.engine if placement.kind != "open" and placement.branch is not None else None
        while True:
            engine = await self.pool.acquire(pinned, session.session_id, frozenset(tried))
            ctx.engine, ctx.engine_attempts = engine.id, len(tried) + 1
            failed = True
            try:
                turn, placement = await self._on_engine(ctx, session, request, placement, body, engine)
                failed = False
                return turn, placement
            except (EngineUnavailable, EngineConnectionLost) as exc:
                self.pool.unreachable(engine, exc)
                tried.add(engine.id)
                if len(tried) >= len(self.pool.engines):
                    raise
                logger.warning("call %s: engine %s failed before the turn was whole (%s); trying another",
                               ctx.label, engine.id, exc.message)
            finally:
                self.pool.release(engine, failed=failed)

    async def _on_engine(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                         placement: Placement, body: dict[str, Any], engine: Engine) -> tuple[EngineTurn, Placement]:
        """The call on one engine: exactly continued through its token endpoints where the session's mode and
        the engine allow, else rendered whole by its chat endpoint."""
        if placement.kind != "open" and await self._exact_mode(session, engine):
            with contextlib.suppress(TokenApiMissing):
                return await self._exact(ctx, session, request, placement, body, engine)
        turn = await engine.client.complete(body)
        ctx.continuation = _rendered_continuation(placement, await ctx.numbered(), self._fallback(session, engine))
        return turn, placement

    async def _exact(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                     placement: Placement, body: dict[str, Any], engine: Engine) -> tuple[EngineTurn, Placement]:
        """One call through the engine's token endpoints: render, build the prompt, generate, derender."""
        model = ctx.served_model or ""
        tokens, continuations = engine.tokens, engine.continuations
        rendered = await tokens.render(body)
        full = list(rendered["token_ids"])
        prompt, prefix, closed_cut = full, 0, False
        branch = placement.branch
        if placement.kind == "continue":
            try:
                exact = await continuations.extend(placement, request, model)
                prompt, prefix, closed_cut = exact.token_ids, exact.prefix_tokens, exact.closed_cut_turn
            except (CannotContinue, ProxyError) as exc:
                # Never a failed call for this: the full render is the prompt, and the event says why.
                reason = exc.reason if isinstance(exc, CannotContinue) else f"continuation_failed:{exc.kind}"
                placement = replace(placement, kind="open", branch=None, opened=reason,
                                    role=branch.role if branch else placement.role)
        elif placement.kind == "retry" and branch is not None:
            prompt, prefix = branch.last_prompt, branch.prompt_length
        generation = await tokens.generate(
            TokenApi.generate_body(rendered, prompt, self._room(request, prompt)))
        turn = await tokens.derender(generation, body, prompt, model)
        ctx.weight_versions = numbered_spans(generation.weight_versions)
        ctx.policy_version = sampled_version(ctx.weight_versions) or ctx.policy_version
        exact_mode = placement.kind in ("continue", "retry") and placement.branch is not None
        sequence = await ctx.numbered()
        drift = None
        if exact_mode:
            assert placement.branch is not None
            drift = await continuations.drift(placement.branch, prompt, full, request, model)
        ctx.continuation = Continuation(
            mode="exact" if exact_mode else "rendered",
            branch=placement.branch.branch_id if placement.branch else branch_id_for(sequence),
            role=placement.branch.role if placement.branch else placement.role,
            parent_sequence=_parent(placement), prefix_tokens=prefix if exact_mode else 0,
            new_tokens=len(prompt) - (prefix if exact_mode else 0), closed_cut_turn=closed_cut,
            opened=placement.opened, drift=drift,
            retry_of_sequence=placement.branch.last_sequence if placement.kind == "retry" and placement.branch
            else None)
        return turn, placement

    @staticmethod
    def _fallback(session: LiveSession, engine: Engine) -> str | None:
        """Why a call of an exact-mode session was rendered whole although it continues a branch."""
        if session.spec.engine.continuation == "exact" and engine.tokens.available is False:
            return "engine_has_no_token_api"
        return None

    async def _exact_mode(self, session: LiveSession, engine: Engine | None = None) -> bool:
        if session.spec.engine.continuation != "exact":
            return False
        engine = engine or self.pool.any()
        try:
            return await engine.tokens.probe(await engine.client.served_model())
        except ProxyError:
            return False  # the engine is not there: the call's own path reports that

    def _room(self, request: NormalizedRequest, prompt: list[int]) -> int | None:
        """Output tokens for a prompt of this length: the request's, within what the context leaves."""
        wanted = request.sampling.max_tokens
        limit = self.pool.any().client.max_model_len
        if limit is None:
            return wanted
        room = limit - len(prompt)
        if room <= 0:
            raise ContextOverflow(f"the prompt is {len(prompt)} tokens; the engine's context is {limit}")
        return room if wanted is None else min(wanted, room)

    async def stream(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                     renderer: Renderer) -> AsyncIterator[bytes]:
        """The reply as byte chunks of the provider's stream; recording happens before the closing chunks.

        A ProxyError raised before the first chunk propagates (the caller answers with an HTTP error);
        after it, the error is rendered into the stream, so the harness sees a failed call (never a
        normal stop, never a reset connection). Either way the failure is recorded first.
        """
        self._in_flight += 1  # until the stream is done or closed (drain)
        try:
            harness_request = request
            opened = await self._open_stream(ctx, session, effective_request(request, session.spec.engine),
                                             harness_request)
            if opened is None:
                # An exact continuation's reply is parsed by the engine's derender once it is whole: its stream
                # is synthesized from the recorded turn (first bytes when the turn is done).
                async for chunk in self._synthetic_stream(ctx, session, harness_request, renderer):
                    yield chunk
                return
            request, placement, engine, batches = opened.request, opened.placement, opened.engine, opened.batches
            admission: Admission | None = opened.admission
            assembler = TurnAssembler()
            link: ChainLink | None = None
            outcome = "aborted"
            started = False  # once a chunk is out, errors can only be told in the stream itself
            try:
                relay_failed = True
                try:
                    async for batch in batches:
                        ctx.stages.first_bytes()
                        out: list[bytes] = []
                        for delta in batch:
                            if ctx.first_token_at is None and (delta.token_ids or delta.has_text):
                                ctx.first_token_at = utcnow()
                            assembler.add(delta)
                            if assembler.prompt_pending:
                                self._deferred.add(assembler.settle_prompt)
                            out += renderer.stream_delta(delta)
                        if out:
                            # One write for what one read brought: a proxy behind the engine catches up in
                            # bigger writes rather than falling further behind one token at a time.
                            started = True
                            yield b"".join(out)
                    relay_failed = False
                finally:
                    await batches.aclose()
                    self.pool.release(engine, failed=relay_failed)
                    opened.admission.leave()
                ctx.stages.relayed()
                turn = assembler.turn()
                ctx.continuation = _rendered_continuation(placement, ctx.sequence, self._fallback(session, engine))
                outcome = "recording"
                link = await self._record_shielded(ctx, request, turn)
                outcome = "recorded"
            except Exception as exc:
                outcome = "failed"
                if admission is not None:
                    admission.leave()
                error = as_proxy_error(exc, f"call {ctx.label}")
                await self.record_failure(ctx, request, error, assembler.turn())
                if not started:
                    raise error from exc
                yield b"".join(renderer.stream_error(error))
                return
            finally:
                if admission is not None:
                    admission.leave()
                if outcome == "aborted":
                    # The harness went away (we were cancelled or closed mid-stream): record that in a task of
                    # its own, since this one may not await anything any more.
                    error = self._cut("the client closed the stream before it ended")
                    self._detach(self.record_failure(ctx, request, error, assembler.turn()))
            try:
                yield ClosingChunk(b"".join(renderer.stream_finish(turn)))
            finally:
                # After the closing chunk is written (with the body's end: proxy/relay.py), not before: calls
                # whose acks come back in one batch each get their end out without waiting for the others'
                # bookkeeping. Nothing awaits between that write and this (the server writes without yielding
                # to the loop), so the session's next call still finds its branch; a hang-up at the write (the
                # generator closed) runs it too.
                _remember(session, placement, request, ctx.sequence, turn, harness_request, link, ctx.engine)
                self.metrics.event("ok")
                self.metrics.continuation(ctx.api, ctx.continuation)
                self.metrics.stages(ctx.api, ctx.stages)
        finally:
            self._in_flight -= 1

    async def _open_stream(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                           harness_request: NormalizedRequest) -> _OpenStream | None:
        """The call's stream from an engine of the pool, its first bytes in and its number confirmed; None when
        the call is served whole instead (an exact continuation: its stream is synthesized). A call placed
        before its number was in that proves stale once the number comes is placed again (the first engine
        stream dropped). A failure is recorded and raised, nothing having reached the harness; a cancellation
        (the harness hung up) is recorded in the background."""
        while True:
            admission: Admission | None = None
            fitted = request
            try:
                placement = await self._place(ctx, session, request, harness_request)
                if not self.upstream_stream or placement.kind != "open" and await self._exact_mode(session):
                    return None
                await self.recorder.ensure_ready()
                admission = await self._admit(ctx, session)
                fitted, body, ctx.served_model = await self._prepare(request, stream=True)
                ctx.upstream_started_at = utcnow()
                ctx.stages.upstream_starts()
                engine, batches = await self._stream_on_pool(ctx, session, placement, body)
                try:
                    confirmed = await self._confirmed(ctx, session)
                except BaseException:
                    await batches.aclose()
                    self.pool.release(engine)
                    raise
                if confirmed:
                    return _OpenStream(fitted, placement, engine, batches, admission)
                await batches.aclose()
                self.pool.release(engine)
                admission.leave()
            except asyncio.CancelledError:
                if admission is not None:
                    admission.leave()
                gone = self._cut("the client closed the stream before it ended")
                self._detach(self.record_failure(ctx, fitted, gone, None))
                raise
            except Exception as exc:
                if admission is not None:
                    admission.leave()
                error = as_proxy_error(exc, f"call {ctx.label}")
                await self.record_failure(ctx, fitted, error, None)
                raise error from exc

    async def _stream_on_pool(self, ctx: CallContext, session: LiveSession, placement: Placement,
                              body: dict[str, Any]) -> tuple[Engine, AsyncGenerator[list[EngineDelta], None]]:
        """A relayed stream from an engine of the pool, held until the caller releases it. An engine that
        cannot be reached, or breaks before its first bytes, is taken out of rotation and the next one
        asked; once bytes have come, a broken stream is a failed call."""
        tried: set[str] = set()
        pinned = placement.branch.engine if placement.kind != "open" and placement.branch is not None else None
        while True:
            engine = await self.pool.acquire(pinned, session.session_id, frozenset(tried))
            ctx.engine, ctx.engine_attempts = engine.id, len(tried) + 1
            batches = engine.client.stream(body)
            try:
                first = await anext(batches)
            except StopAsyncIteration:
                return engine, _replay([], batches)
            except (EngineUnavailable, EngineConnectionLost) as exc:
                await batches.aclose()
                self.pool.release(engine, failed=True)
                self.pool.unreachable(engine, exc)
                tried.add(engine.id)
                if len(tried) >= len(self.pool.engines):
                    raise
                continue
            except BaseException:
                await batches.aclose()
                self.pool.release(engine, failed=True)
                raise
            return engine, _replay([first], batches)

    def _detach(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _synthetic_stream(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                                renderer: Renderer) -> AsyncIterator[bytes]:
        turn = await self._whole(ctx, session, request)
        started = time.perf_counter()
        chunks = b"".join(renderer.stream_whole(turn))
        ctx.stages.relay = time.perf_counter() - started
        self.metrics.stages(ctx.api, ctx.stages)
        yield chunks


@dataclass(frozen=True, slots=True)
class _OpenStream:
    """A call's engine stream, ready to relay: the request as sent, its placement, and what it holds."""

    request: NormalizedRequest
    placement: Placement
    engine: Engine
    batches: AsyncGenerator[list[EngineDelta], None]
    admission: Admission


async def _replay(ahead: list[list[EngineDelta]], rest: AsyncIterator[list[EngineDelta]],
                  ) -> AsyncGenerator[list[EngineDelta], None]:
    """The batches already read, then the rest of the stream."""
    for batch in ahead:
        yield batch
    async for batch in rest:
        yield batch


def _unless_gone(hangup: Hangup | None, work: Coroutine[Any, Any, T], waiting_for: str) -> Awaitable[T]:
    """``work``, cut short by the client's hang-up when there is a watcher (see proxy.hangups)."""
    return work if hangup is None else hangup.guard(work, waiting_for)


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has finished (whatever it ended with is of no use any more)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a background task's outcome as seen (whoever awaits it, if anyone still does, reports it)."""
    if not task.cancelled():
        task.exception()


def _parent(placement: Placement) -> int | None:
    branch = placement.branch
    if branch is None:
        return None
    return branch.last_parent if placement.kind == "retry" else branch.last_sequence


def _rendered_continuation(placement: Placement, sequence: int, fallback: str | None) -> Continuation:
    """The event's continuation block for a prompt the chat endpoint rendered whole: a new branch (its
    prompt is the full render in either mode, so the chat endpoint serves it, streaming as it samples), a
    session in rendered mode, or ``fallback`` (an engine without the token endpoints: the event says so)."""
    branch = placement.branch
    return Continuation(mode="rendered", branch=branch.branch_id if branch else branch_id_for(sequence),
                        role=branch.role if branch else placement.role, parent_sequence=_parent(placement),
                        opened=fallback or placement.opened,
                        retry_of_sequence=branch.last_sequence if placement.kind == "retry" and branch else None)


def _delta_parent(placement: Placement, continuation: Continuation | None) -> ChainLink | None:
    """The event a call's event may be written as a delta against: its branch's last recorded event, when
    the call continues (or retries) that branch exactly."""
    if continuation is None or continuation.mode != "exact" or placement.kind == "open" or placement.branch is None:
        return None
    return placement.branch.link


def _remember(session: LiveSession, placement: Placement, request: NormalizedRequest, sequence: int,
              turn: EngineTurn, harness_request: NormalizedRequest, link: ChainLink | None,
              engine: str | None) -> None:
    """The recorded turn becomes its branch's new end (a new branch for an ``open`` placement); ``link`` is
    its recorded event."""
    store = session.branches
    branch = placement.branch if placement.kind != "open" else None
    if branch is None:
        branch = store.open(placement, request, sequence, harness_request)
        branch.last_parent = None
    elif placement.kind == "continue":
        branch.last_parent = branch.last_sequence
    served = ChatMessage(role="assistant", content=turn.content, reasoning=turn.reasoning,
                         tool_calls=turn.tool_calls)
    store.record(branch, request, sequence, turn.prompt_token_ids, turn.token_ids, served, turn.finish_reason,
                 closed=turn.ends_on_end_id, retry=placement.kind == "retry", link=link)
    branch.engine = engine


def _check_turn(turn: EngineTurn) -> None:
    """The engine must give token data and say how the turn ended: without them the call cannot be used
    for training (a turn with no finish reason may be cut off, and must not reach training as complete)."""
    if turn.prompt_error is not None:
        raise EngineFailed(turn.prompt_error)
    if not turn.prompt_token_ids:
        raise EngineFailed("the engine returned no prompt_token_ids: is it vLLM with return_token_ids support?")
    if turn.logprobs and len(turn.logprobs) != len(turn.token_ids):
        raise EngineFailed(f"the engine returned {len(turn.logprobs)} logprobs for {len(turn.token_ids)} tokens")
    if turn.finish_reason is None:
        raise EngineFailed("the engine's reply ended without a finish reason: the turn may be cut off, so it "
                           "is not served or recorded as complete")
