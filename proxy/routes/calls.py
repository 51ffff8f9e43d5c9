"""Model calls on the four provider APIs: Chat Completions, Responses, Messages and Gemini.

Each path is served by key (``/v1/...``) and under its session's path (``/s/{session_id}/v1/...``): the
router is attached twice (:func:`proxy.routes.attach_routers`), so every endpoint takes an optional
``session_id``. :func:`serve_call` is the one place that authenticates a call, reads its body within limits,
and turns any failure into a recorded failed call and an answer in the provider's shape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response, WebSocket
from fastapi.responses import JSONResponse

from proxy.apis import model_catalog as catalog
from proxy.apis.anthropic_messages import MessagesApi
from proxy.calls import retrieved
from proxy.capture import EMPTY_REQUEST, CallContext, body_digest
from proxy.errors import CaptureFailed, ClientDisconnected, NotFound, ProxyError, UpgradeRequired, as_proxy_error
from proxy.apis.gemini import GeminiApi
from proxy.hangups import Hangup
from proxy.limits import check_request, decode_json_body, read_body, require_json_media_type
from proxy.apis.openai_chat import ChatCompletionsApi
from proxy.apis.openai_responses import ResponsesApi
from proxy.apis.base import ParsedCall, ProviderAdapter, Route
from proxy.relay import RelayResponse
from proxy.routes.access import call_session
from proxy.session_registry import LiveSession
from proxy.stages import StageTimes
from proxy.state import proxy_state
from schemas.completions import NormalizedRequest, ProviderApi

router = APIRouter()

chat = ChatCompletionsApi()
responses = ResponsesApi()
messages = MessagesApi()
gemini = GeminiApi()

_NO_ROUTE = Route()
_HINT_HEADERS = ("user-agent", "x-stainless-retry-count", "x-claude-code-session-id", "session_id",
                 "conversation_id", "x-rollwire-agent", "x-rollwire-parent")
_MAX_RETRY_COUNT = 10_000
# Bodies above this are decoded and parsed in a worker thread, so one large request (or one that inflates
# reasoning signatures up to their limit) never stalls the event loop that serves every other stream.
_PARSE_INLINE_BYTES = 256 * 1024


def _requested_model(document: Any, route: Route) -> str | None:
    """The model a request names, read without trusting its shape (for the events of refused calls)."""
    if route.model is not None:
        return route.model
    model = document.get("model") if isinstance(document, dict) else None
    return model if isinstance(model, str) else None


def _retry_count(header: str) -> int:
    """An SDK's retry counter, read without trusting it: ASCII digits, capped (anything else is 0)."""
    if not (header.isascii() and header.isdigit()):
        return 0
    return _MAX_RETRY_COUNT if len(header) > 6 else min(int(header), _MAX_RETRY_COUNT)


def _context(request: Request, session: LiveSession, api: ProviderApi, raw: bytes | None,
             started: float) -> CallContext:
    """Start numbering the call on the claims log (from here on it will have an event) and gather what is
    known before parsing. The claim is written while the call is parsed, placed and sent to the engine;
    the call waits for its number only before its first byte goes to the harness (proxy/calls.py)."""
    state = proxy_state(request)
    keep_body = state.settings.record_request_body
    digest = body_digest(raw) if raw is not None else None
    retry_count = _retry_count(request.headers.get("x-stainless-retry-count", "0"))
    numbering = asyncio.ensure_future(_claim(request, session.session_id, digest, retry_count))
    numbering.add_done_callback(retrieved)  # a failed claim is answered by the call that waits for it
    hints = {name: request.headers[name] for name in _HINT_HEADERS if name in request.headers}
    body = raw.decode("utf-8", errors="replace") if keep_body and raw is not None else None
    # policy_version: the engine's, once the call passes the policy gate (proxy/calls.py); None before.
    return CallContext(api=api, session_id=session.session_id, task_id=session.spec.task_id,
                       policy_version=None, sequence=-1, requested_model=None, served_model=None,
                       digest=digest, body=body, retry_count=retry_count, agent_hints=hints,
                       proxy=state.settings.instance, stages=StageTimes(started=started), numbering=numbering)


async def _claim(request: Request, session_id: str, digest: str | None, retry_count: int) -> tuple[int, int | None]:
    state = proxy_state(request)
    numbering = time.perf_counter()
    numbered = await state.numbers.claim(session_id, digest, retry_count)
    state.metrics.call_numbers.observe(time.perf_counter() - numbering)
    return numbered.sequence, numbered.retry_of



async def _parse(provider: ProviderAdapter, raw: bytes, route: Route) -> tuple[Any, ParsedCall]:
    def parse() -> tuple[Any, ParsedCall]:
        document = decode_json_body(raw)
        call = provider.parse(document, route)
        check_request(call.request)
        return document, call

    if len(raw) <= _PARSE_INLINE_BYTES:
        return parse()
    return await asyncio.to_thread(parse)


async def serve_call(request: Request, provider: ProviderAdapter, session_id: str | None,
                     route: Route = _NO_ROUTE, refusal: ProxyError | None = None) -> Response:
    """One model call on any provider API.

    Order: the key (401 before anything is read), then the body is read and the call's claim written (its
    number comes back while the call goes on), then the body is decoded and parsed. Every call past the key
    leaves exactly one completion event.
    """
    state = proxy_state(request)
    started = time.perf_counter()
    status = 500
    ctx: CallContext | None = None
    hangup: Hangup | None = None
    document: Any = None
    normalized: NormalizedRequest = EMPTY_REQUEST
    try:
        session = await call_session(request, session_id)
        raw: bytes | None = None
        try:
            if refusal is not None:
                raise refusal
            require_json_media_type(request)
            raw = await read_body(request, state.max_body_bytes)
        finally:
            ctx = _context(request, session, provider.name, raw, started)
        assert raw is not None
        # From here until the reply starts, a harness that hangs up (its SDK's timeout) cancels the
        # call's wait for the engine, and the call is recorded as abandoned (proxy/hangups.py).
        hangup = Hangup(request.receive)
        document, call = await _parse(provider, raw, route)
        normalized = call.request
        ctx.requested_model = call.requested_model
        if not call.stream:
            turn = await state.service.whole(ctx, session, call.request, hangup)
            status = 200
            rendering = time.perf_counter()
            reply = JSONResponse(call.renderer.response(turn))
            ctx.stages.relay = time.perf_counter() - rendering
            state.metrics.stages(provider.name, ctx.stages)
            return reply
        chunks = state.service.stream(ctx, session, call.request, call.renderer)
        try:
            first = await hangup.guard(anext(chunks, None), "the engine's first tokens")
        except ClientDisconnected as exc:
            exc.recorded = True  # by the stream itself, cancelled (or its turn, if it was being recorded)
            raise
        status = 200
        relay = RelayResponse(first, chunks, media_type=provider.stream_media_type,
                              headers={"cache-control": "no-cache"}, hangup=hangup)
        hangup = None  # the response watches the connection from here on
        return relay
    except Exception as exc:
        error = as_proxy_error(exc, request.url.path)
        status = error.status_code
        if ctx is not None:
            if ctx.requested_model is None:
                ctx.requested_model = _requested_model(document, route)
            await state.service.record_failure(ctx, normalized, error)
        elif not isinstance(error, CaptureFailed):
            state.metrics.error(provider.name, error.kind)
        return JSONResponse(provider.error_body(error), status_code=error.status_code)
    finally:
        if hangup is not None:
            hangup.stop()
        state.metrics.requests.labels(api=provider.name, status=str(status)).inc()
        state.metrics.latency.labels(api=provider.name).observe(time.perf_counter() - started)


async def count_tokens(request: Request, session_id: str | None, parse: Callable[[Any], NormalizedRequest],
                       error_body: Callable[[ProxyError], dict[str, Any]],
                       answer: Callable[[int], dict[str, Any]]) -> Response:
    """A prompt's token count by the engine's tokenizer and template (not a model call: not recorded)."""
    state = proxy_state(request)
    try:
        await call_session(request, session_id)
        require_json_media_type(request)
        document = decode_json_body(await read_body(request, state.max_body_bytes))
        count = await state.engine.count_prompt_tokens(parse(document))
    except Exception as exc:
        error = as_proxy_error(exc, request.url.path)
        return JSONResponse(error_body(error), status_code=error.status_code)
    return JSONResponse(answer(count))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, session_id: str | None = None) -> Response:
    return await serve_call(request, chat, session_id)


@router.post("/v1/responses")
async def create_response(request: Request, session_id: str | None = None) -> Response:
    return await serve_call(request, responses, session_id)


@router.get("/v1/responses")
async def responses_websocket(session_id: str | None = None) -> Response:
    """Codex tries a WebSocket upgrade first with some providers; 426 sends it straight to HTTP + SSE."""
    error = UpgradeRequired("this server speaks the Responses API over HTTP (POST with SSE), not WebSocket")
    return JSONResponse(responses.error_body(error), status_code=error.status_code)


@router.websocket("/v1/responses")
async def responses_websocket_handshake(websocket: WebSocket, session_id: str | None = None) -> None:
    """A real handshake reaches the server as a WebSocket scope: denied with the same 426 (not 403)."""
    await websocket.send_denial_response(await responses_websocket(session_id))


@router.post("/v1/messages")
async def create_message(request: Request, session_id: str | None = None) -> Response:
    return await serve_call(request, messages, session_id)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(request: Request, session_id: str | None = None) -> Response:
    return await count_tokens(request, session_id, messages.parse_count, messages.error_body,
                              lambda count: {"input_tokens": count})


CallEndpoint = Callable[[Request, "str | None"], Awaitable[Response]]
_DIRECT: dict[str, CallEndpoint] = {"/v1/chat/completions": chat_completions, "/v1/responses": create_response,
                                    "/v1/messages": create_message}


def direct_endpoint(path: str) -> tuple[CallEndpoint, str | None] | None:
    """The endpoint of a POST on ``path`` and the session its path names, for the model calls the app hands
    to their endpoint without the framework's routing (proxy/app.py); None for any other path (Gemini's,
    whose method is in its path, included: those go through the router)."""
    session_id: str | None = None
    if path.startswith("/s/"):
        session_id, slash, rest = path[3:].partition("/")
        if not session_id or not slash:
            return None
        path = "/" + rest
    endpoint = _DIRECT.get(path)
    return None if endpoint is None else (endpoint, session_id)


# google-genai (Python) 1.x and later calls v1 by default, the JS SDK and the CLIs v1beta; the method
# names and bodies are the same. (OpenAI has no POST under /v1/models, so nothing is shadowed.)
@router.post("/v1beta/models/{target:path}")
@router.post("/v1/models/{target:path}")
@router.post("/v1alpha/models/{target:path}")
async def gemini_method(request: Request, target: str, session_id: str | None = None) -> Response:
    model, _, method = target.rpartition(":")
    if method == "countTokens" and model:
        return await count_tokens(
            request, session_id,
            lambda document: gemini.parse(catalog.gemini_count_document(document), Route(model=model)).request,
            gemini.error_body, lambda count: {"totalTokens": count})
    refusal = None
    if method not in ("generateContent", "streamGenerateContent") or not model:
        refusal = NotFound(f"no Gemini method {target!r}: use models/MODEL:generateContent, "
                           "models/MODEL:streamGenerateContent or models/MODEL:countTokens")
    route = Route(model=model or None, stream=method == "streamGenerateContent", query=dict(request.query_params))
    return await serve_call(request, gemini, session_id, route, refusal)

