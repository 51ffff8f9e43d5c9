"""Serving one model call, whatever the provider API: engine, capture, and the reply held until recorded.

A provider module parses and normalizes the request and supplies a :class:`Renderer`; this module does
the rest. Whole replies are returned only after the completion event is acknowledged. Streams are
relayed as the engine produces them, but their closing part (finish reason, usage, end marker) is sent
only once the event is acknowledged; if capture fails the stream ends with an error instead, so the
harness retries rather than keeping unrecorded tokens. A failed call is recorded too, with its reason,
exactly once (:meth:`CallService.record_failure`; the HTTP layer uses it for calls refused before they
reach the engine).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from proxy.capture import CallContext, Recorder, completion_event
from proxy.engine import (
    EngineTurn,
    TurnAssembler,
    VllmEngine,
    effective_request,
    engine_body,
    fit_max_tokens,
)
from proxy.errors import (
    CaptureFailed,
    ClientDisconnected,
    EngineFailed,
    ProxyError,
    UnrecordableEvent,
    as_proxy_error,
)
from proxy.metrics import ProxyMetrics
from proxy.providers import Renderer
from proxy.sessions import LiveSession
from schemas.completions import NormalizedRequest
from schemas.envelope import utcnow

logger = logging.getLogger(__name__)


class CallService:
    """Runs calls against the engine and records them: every call that reaches it leaves one event."""

    def __init__(self, engine: VllmEngine, recorder: Recorder, metrics: ProxyMetrics, *,
                 upstream_stream: bool = True) -> None:
        self.engine = engine
        self.recorder = recorder
        self.metrics = metrics
        self.upstream_stream = upstream_stream
        self._background: set[asyncio.Task[None]] = set()

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

    async def _record_turn(self, ctx: CallContext, request: NormalizedRequest, turn: EngineTurn) -> None:
        _check_turn(turn)
        await self.recorder.record_completion(completion_event(ctx, request, turn))

    async def _prepare(self, request: NormalizedRequest, stream: bool) -> tuple[NormalizedRequest, dict, str]:
        """The request as it will be sent (fitted to the engine), its engine body, and the served model."""
        model = await self.engine.served_model()
        request = fit_max_tokens(request, self.engine.max_model_len)
        return request, engine_body(request, model, stream=stream), model

    async def whole(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest) -> EngineTurn:
        """Call the engine, record the event, and return the turn (raises ProxyError, already recorded)."""
        request = effective_request(request, session.spec.engine)
        turn: EngineTurn | None = None
        try:
            await self.recorder.ensure_ready()
            request, body, ctx.served_model = await self._prepare(request, stream=False)
            ctx.upstream_started_at = utcnow()
            turn = await self.engine.complete(body)
            ctx.first_token_at = utcnow()
            await self._record_turn(ctx, request, turn)
        except Exception as exc:
            error = as_proxy_error(exc, f"call {ctx.session_id}/{ctx.sequence}")
            await self.record_failure(ctx, request, error, turn)
            raise error from exc
        self.metrics.event("ok")
        return turn

    async def stream(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                     renderer: Renderer) -> AsyncIterator[bytes]:
        """The reply as byte chunks of the provider's stream; recording happens before the closing chunks.

        A ProxyError raised before the first chunk propagates (the caller answers with an HTTP error);
        after it, the error is rendered into the stream, so the harness sees a failed call (never a
        normal stop, never a reset connection). Either way the failure is recorded first.
        """
        if not self.upstream_stream:
            async for chunk in self._synthetic_stream(ctx, session, request, renderer):
                yield chunk
            return
        request = effective_request(request, session.spec.engine)
        assembler = TurnAssembler()
        outcome = "aborted"
        started = False  # once a chunk is out, errors can only be told in the stream itself
        try:
            await self.recorder.ensure_ready()
            request, body, ctx.served_model = await self._prepare(request, stream=True)
            ctx.upstream_started_at = utcnow()
            deltas = self.engine.stream(body)
            try:
                async for delta in deltas:
                    if ctx.first_token_at is None and (delta.token_ids or delta.has_text):
                        ctx.first_token_at = utcnow()
                    assembler.add(delta)
                    for chunk in renderer.stream_delta(delta):
                        started = True
                        yield chunk
            finally:
                await deltas.aclose()
            turn = assembler.turn()
            await self._record_turn(ctx, request, turn)
            outcome = "recorded"
        except Exception as exc:
            outcome = "failed"
            error = as_proxy_error(exc, f"call {ctx.session_id}/{ctx.sequence}")
            await self.record_failure(ctx, request, error, assembler.turn())
            if not started:
                raise error from exc
            for chunk in renderer.stream_error(error):
                yield chunk
            return
        finally:
            if outcome == "aborted":
                # The harness went away (we were cancelled or closed mid-stream): record that in a task of
                # its own, since this one may not await anything any more.
                error = ClientDisconnected("the client closed the stream before it ended")
                self._detach(self.record_failure(ctx, request, error, assembler.turn()))
        self.metrics.event("ok")
        for chunk in renderer.stream_finish(turn):
            yield chunk

    def _detach(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _synthetic_stream(self, ctx: CallContext, session: LiveSession, request: NormalizedRequest,
                                renderer: Renderer) -> AsyncIterator[bytes]:
        turn = await self.whole(ctx, session, request)
        for chunk in renderer.stream_whole(turn):
            yield chunk


def _check_turn(turn: EngineTurn) -> None:
    """The engine must give token data and say how the turn ended: without them the call cannot be used
    for training (a turn with no finish reason may be cut off, and must not reach training as complete)."""
    if not turn.prompt_token_ids:
        raise EngineFailed("the engine returned no prompt_token_ids: is it vLLM with return_token_ids support?")
    if turn.logprobs and len(turn.logprobs) != len(turn.token_ids):
        raise EngineFailed(f"the engine returned {len(turn.logprobs)} logprobs for {len(turn.token_ids)} tokens")
    if turn.finish_reason is None:
        raise EngineFailed("the engine's reply ended without a finish reason: the turn may be cut off, so it "
                           "is not served or recorded as complete")
