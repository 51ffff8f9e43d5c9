"""The proxy's HTTP app: routes for each provider API, the session API, health and metrics.

Routes stay thin: they authenticate the call (the session's key, also on ``/s/{id}/`` paths), read the
body within limits (:mod:`proxy.limits`), and hand the call to :class:`~proxy.calls.CallService`. Errors
are rendered in the caller's protocol (OpenAI's, Anthropic's or Gemini's error object on their routes,
unknown paths and methods under them included; ``{"detail": ...}`` on rollwire's own API), and every
call past the key is recorded, refused ones as failed calls.

The policy API (``GET /v1/policy``, ``POST /v1/policy/weights``: :mod:`proxy.policy`) answers
:class:`~schemas.api.PolicyState`; with ``ROLLWIRE_PROXY_ADMIN_TOKEN`` set it needs that token as a
bearer token (a session's key never works there).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request, Response, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.anthropic_messages import MessagesApi
from proxy.gemini import GeminiApi
from proxy.openai_chat import ChatCompletionsApi
from proxy.openai_responses import ResponsesApi
from proxy import model_catalog as catalog
from proxy.calls import CallService
from proxy.capture import EMPTY_REQUEST, CallContext, Recorder, body_digest
from proxy.engine import VllmEngine
from proxy.errors import CaptureFailed, ClientDisconnected, NotFound, ProxyError, UpgradeRequired, as_proxy_error
from proxy.hangups import Hangup
from proxy.limits import check_request, decode_json_body, read_body, require_json_media_type
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.providers import ParsedCall, ProviderAdapter, Route
from proxy.relay import RelayResponse
from proxy.session_registry import LiveSession, RegistryFeed, SessionRegistry
from proxy.settings import ProxySettings
from proxy.stages import StageTimes
from proxy.weight_api import WeightApi
from schemas.api import PolicyState, SessionCreate, SessionCreated, SessionEnd, SessionState, WeightUpdate
from schemas.codec import unreadable_reason
from schemas.completions import NormalizedRequest, ProviderApi
from schemas.sessions import SessionEnded, SessionSpec
from schemas.transport import KafkaSettings

logger = logging.getLogger(__name__)

_HINT_HEADERS = ("user-agent", "x-stainless-retry-count", "x-claude-code-session-id", "session_id",
                 "conversation_id", "x-rollwire-agent", "x-rollwire-parent")

_NO_ROUTE = Route()


@dataclass
class ProxyState:
    settings: ProxySettings
    kafka: KafkaSettings
    registry: SessionRegistry
    feed: RegistryFeed
    recorder: Recorder
    engine: VllmEngine
    policy: Policy
    service: CallService
    metrics: ProxyMetrics
    max_body_bytes: int


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or request.headers.get("x-goog-api-key") or request.query_params.get("key")


def _requested_model(document: Any, route: Route) -> str | None:
    """The model a request names, read without trusting its shape (for the events of refused calls)."""
    if route.model is not None:
        return route.model
    model = document.get("model") if isinstance(document, dict) else None
    return model if isinstance(model, str) else None


_MAX_RETRY_COUNT = 10_000


def _retry_count(header: str) -> int:
    """An SDK's retry counter, read without trusting it: ASCII digits, capped (anything else is 0)."""
    if not (header.isascii() and header.isdigit()) or len(header) > 6:
        return 0 if not (header.isascii() and header.isdigit()) else _MAX_RETRY_COUNT
    return min(int(header), _MAX_RETRY_COUNT)


def _context(request: Request, api: ProviderApi, session: LiveSession, raw: bytes | None,
             keep_body: bool, started: float) -> CallContext:
    """Number the call (from here on it will have an event) and gather what is known before parsing."""
    digest = body_digest(raw) if raw is not None else None
    retry_count = _retry_count(request.headers.get("x-stainless-retry-count", "0"))
    sequence, retry_of = session.take_sequence(digest, retry_count)
    hints = {name: request.headers[name] for name in _HINT_HEADERS if name in request.headers}
    body = raw.decode("utf-8", errors="replace") if keep_body and raw is not None else None
    # policy_version: the engine's, once the call passes the policy gate (proxy/calls.py); None before.
    return CallContext(api=api, session_id=session.session_id, task_id=session.spec.task_id,
                       policy_version=None, sequence=sequence,
                       requested_model=None, served_model=None, digest=digest, body=body,
                       retry_of=retry_of, retry_count=retry_count, agent_hints=hints,
                       stages=StageTimes(started=started))


# Bodies above this are decoded and parsed in a worker thread, so one large request (or one that inflates
# reasoning signatures up to their limit) never stalls the event loop that serves every other stream.
_PARSE_INLINE_BYTES = 256 * 1024


async def _parse(provider: ProviderAdapter, raw: bytes, route: Route) -> tuple[Any, ParsedCall]:
    def parse() -> tuple[Any, ParsedCall]:
        document = decode_json_body(raw)
        call = provider.parse(document, route)
        check_request(call.request)
        return document, call

    if len(raw) <= _PARSE_INLINE_BYTES:
        return parse()
    return await asyncio.to_thread(parse)


def _provider_for_path(path: str) -> str:
    if "/v1beta/" in path or "/v1alpha/" in path or ("/v1/models/" in path and ":" in path.rpartition("/")[2]):
        return "gemini"
    if "/v1/messages" in path:
        return "anthropic"
    if path.startswith(("/v1/sessions", "/v1/policy")):
        return "rollwire"
    return "openai"


def create_app(settings: ProxySettings | None = None, kafka: KafkaSettings | None = None, *,
               engine_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy app; Kafka clients and the engine client start with the app's lifespan."""
    settings = settings or ProxySettings()
    kafka = kafka or KafkaSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = ProxyMetrics()
        registry = SessionRegistry()
        recorder = Recorder(kafka, settings.capture_timeout_s, settings.capture_producers,
                            on_outage_end=metrics.capture_outages.observe, compression=settings.capture_compression)
        metrics.capture_failing.set_function(lambda: float(recorder.failing_since is not None))

        def compressed_by(by: str) -> Callable[[], float]:
            return lambda: float(recorder.compression == by)

        for by in ("producer", "broker", "auto"):
            metrics.capture_compression.labels(by=by).set_function(compressed_by(by))
        engine = VllmEngine(settings, transport=engine_transport)
        policy = Policy(WeightApi(engine.client, settings.weight_update_timeout_s), recorder, metrics,
                        engine.served_model, settings.policy_floor_wait_s)
        service = CallService(engine, recorder, metrics, policy, upstream_stream=settings.upstream_stream)
        state = ProxyState(settings, kafka, registry, RegistryFeed(kafka, registry), recorder, engine, policy,
                           service, metrics, settings.max_body_bytes(kafka.max_message_bytes))
        await recorder.start()
        state.feed.start()
        await policy.learn()  # the engine's version now if it is up; else the first call asks
        app.state.proxy = state
        try:
            yield
        finally:
            # Calls the shutdown grace cut are recorded (as proxy_stopped) before the producer closes.
            service.begin_stop()
            await service.drain(settings.capture_timeout_s)
            await state.feed.stop()
            await recorder.stop()
            await engine.aclose()

    app = FastAPI(title="rollwire proxy", lifespan=lifespan)
    # A trailing slash is another path, answered 404 in the provider's shape, not a 307 with an empty body.
    app.router.redirect_slashes = False

    def state_of(request: Request) -> ProxyState:
        return request.app.state.proxy

    # -- provider APIs ------------------------------------------------------------------------------
    async def serve_call(request: Request, provider: ProviderAdapter, session_id: str | None,
                         route: Route = _NO_ROUTE, refusal: ProxyError | None = None) -> Response:
        """One model call on any provider API: the one place that authenticates it, reads its body within
        limits, and turns any failure into a recorded failed call and an answer in the provider's shape.

        Order: the key (401 before anything is read), then the call is numbered, then the body is read,
        decoded and parsed. Every call past the key leaves exactly one completion event.
        """
        state = state_of(request)
        started = time.perf_counter()
        status = 500
        ctx: CallContext | None = None
        hangup: Hangup | None = None
        document: Any = None
        normalized: NormalizedRequest = EMPTY_REQUEST
        try:
            session = await state.registry.authenticate(session_id, _api_key(request), settings.session_wait_s)
            raw: bytes | None = None
            try:
                if refusal is not None:
                    raise refusal
                require_json_media_type(request)
                raw = await read_body(request, state.max_body_bytes)
            finally:
                ctx = _context(request, provider.name, session, raw, settings.record_request_body, started)
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
            hangup.stop()  # the streaming response listens for the hang-up from here on
            return RelayResponse(first, chunks, media_type=provider.stream_media_type,
                                 headers={"cache-control": "no-cache"})
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

    chat = ChatCompletionsApi()

    @app.post("/v1/chat/completions")
    async def chat_by_key(request: Request) -> Response:
        return await serve_call(request, chat, None)

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat_by_path(request: Request, session_id: str) -> Response:
        return await serve_call(request, chat, session_id)

    responses = ResponsesApi()

    @app.post("/v1/responses")
    async def responses_by_key(request: Request) -> Response:
        return await serve_call(request, responses, None)

    @app.post("/s/{session_id}/v1/responses")
    async def responses_by_path(request: Request, session_id: str) -> Response:
        return await serve_call(request, responses, session_id)

    @app.get("/v1/responses")
    @app.get("/s/{session_id}/v1/responses")
    async def responses_websocket(session_id: str | None = None) -> Response:
        # Codex tries a WebSocket upgrade first with some providers; 426 sends it straight to HTTP + SSE.
        error = UpgradeRequired("this server speaks the Responses API over HTTP (POST with SSE), not WebSocket")
        return JSONResponse(responses.error_body(error), status_code=error.status_code)

    @app.websocket("/v1/responses")
    @app.websocket("/s/{session_id}/v1/responses")
    async def responses_websocket_handshake(websocket: WebSocket, session_id: str | None = None) -> None:
        # A real handshake reaches the server as a WebSocket scope: deny it with the same 426 (not 403).
        await websocket.send_denial_response(await responses_websocket(session_id))

    messages = MessagesApi()

    @app.post("/v1/messages")
    async def messages_by_key(request: Request) -> Response:
        return await serve_call(request, messages, None)

    @app.post("/s/{session_id}/v1/messages")
    async def messages_by_path(request: Request, session_id: str) -> Response:
        return await serve_call(request, messages, session_id)

    async def count_tokens(request: Request, session_id: str | None, parse: Callable[[Any], NormalizedRequest],
                           error_body: Callable[[ProxyError], dict[str, Any]],
                           answer: Callable[[int], dict[str, Any]]) -> Response:
        """A prompt's token count by the engine's tokenizer and template (not a model call: not recorded)."""
        state = state_of(request)
        try:
            await state.registry.authenticate(session_id, _api_key(request), settings.session_wait_s)
            require_json_media_type(request)
            document = decode_json_body(await read_body(request, state.max_body_bytes))
            count = await state.engine.count_prompt_tokens(parse(document))
        except Exception as exc:
            error = as_proxy_error(exc, request.url.path)
            return JSONResponse(error_body(error), status_code=error.status_code)
        return JSONResponse(answer(count))

    def count_messages(request: Request, session_id: str | None) -> Awaitable[Response]:
        return count_tokens(request, session_id, messages.parse_count, messages.error_body,
                            lambda count: {"input_tokens": count})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_by_key(request: Request) -> Response:
        return await count_messages(request, None)

    @app.post("/s/{session_id}/v1/messages/count_tokens")
    async def count_tokens_by_path(request: Request, session_id: str) -> Response:
        return await count_messages(request, session_id)

    # -- model listings (proxy/model_catalog.py): not model calls, nothing recorded -----------------------
    async def describe(request: Request, session_id: str | None, error_body: Callable[[ProxyError], dict[str, Any]],
                       answer: Callable[[str, int | None], dict[str, Any]]) -> Response:
        state = state_of(request)
        try:
            await state.registry.authenticate(session_id, _api_key(request), settings.session_wait_s)
            served = await state.engine.served_model()
        except Exception as exc:
            error = as_proxy_error(exc, request.url.path)
            return JSONResponse(error_body(error), status_code=error.status_code)
        return JSONResponse(answer(served, state.engine.max_model_len))

    def shared_path(request: Request, session_id: str | None,
                    answer: Callable[[bool, str], dict[str, Any]]) -> Awaitable[Response]:
        """OpenAI's and Anthropic's model paths are the same: the asker's shape, by its headers."""
        anthropic = catalog.is_anthropic(request.headers)
        return describe(request, session_id, messages.error_body if anthropic else chat.error_body,
                        lambda served, _: answer(anthropic, served))

    @app.get("/v1/models")
    @app.get("/s/{session_id}/v1/models")
    async def list_models(request: Request, session_id: str | None = None) -> Response:
        if catalog.is_gemini(request.headers, request.query_params):
            return await gemini_models(request, session_id)
        return await shared_path(request, session_id, catalog.listing)

    @app.get("/v1/models/{model_id:path}")
    @app.get("/s/{session_id}/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str, session_id: str | None = None) -> Response:
        if catalog.is_gemini(request.headers, request.query_params):
            return await gemini_model(request, model_id, session_id)
        return await shared_path(request, session_id, lambda anthropic, _: catalog.lookup(anthropic, model_id))

    @app.head("/")
    @app.head("/s/{session_id}")
    async def preflight(session_id: str | None = None) -> Response:
        return Response(status_code=200)  # Claude Code's HEAD / before its first call

    gemini = GeminiApi()

    async def gemini_call(request: Request, session_id: str | None, target: str) -> Response:
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
        route = Route(model=model or None, stream=method == "streamGenerateContent",
                      query=dict(request.query_params))
        return await serve_call(request, gemini, session_id, route, refusal)

    @app.get("/v1beta/models")
    @app.get("/s/{session_id}/v1beta/models")
    async def gemini_models(request: Request, session_id: str | None = None) -> Response:
        return await describe(request, session_id, gemini.error_body, catalog.gemini_models)

    @app.get("/v1beta/models/{target:path}")
    @app.get("/s/{session_id}/v1beta/models/{target:path}")
    async def gemini_model(request: Request, target: str, session_id: str | None = None) -> Response:
        if ":" in target:
            error = NotFound(f"GET {request.url.path}: Gemini's methods are POSTed")
            error.status_code = 405
            return JSONResponse(gemini.error_body(error), status_code=405)
        return await describe(request, session_id, gemini.error_body,
                              lambda _, context: catalog.gemini_model(target, context))

    # google-genai (Python) 1.x and later calls v1 by default, the JS SDK and the CLIs v1beta; the method
    # names and bodies are the same. (OpenAI has no POST under /v1/models, so nothing is shadowed.)
    @app.post("/v1beta/models/{target:path}")
    @app.post("/v1/models/{target:path}")
    @app.post("/v1alpha/models/{target:path}")
    async def gemini_by_key(request: Request, target: str) -> Response:
        return await gemini_call(request, None, target)

    @app.post("/s/{session_id}/v1beta/models/{target:path}")
    @app.post("/s/{session_id}/v1/models/{target:path}")
    @app.post("/s/{session_id}/v1alpha/models/{target:path}")
    async def gemini_by_path(request: Request, session_id: str, target: str) -> Response:
        return await gemini_call(request, session_id, target)

    # -- sessions -----------------------------------------------------------------------------------
    # The response models are named: a refusal is returned as a JSONResponse, which FastAPI sends as it is.
    @app.post("/v1/sessions", status_code=201, response_model=SessionCreated,
              openapi_extra={"requestBody": {"content": {"application/json": {
                  "schema": SessionCreate.model_json_schema()}}, "required": True}})
    async def create_session(request: Request) -> SessionCreated | JSONResponse:
        state = state_of(request)
        if (refused := _admin_refusal(request, settings)) is not None:
            return refused
        body = await _api_body(request, SessionCreate)
        if isinstance(body, JSONResponse):
            return body
        session_id = body.session_id or f"adhoc-{secrets.token_hex(8)}"
        api_key = body.api_key or f"rw-{secrets.token_urlsafe(24)}"
        if body.session_id is not None and not await _caught_up(state, max(settings.session_wait_s, 10.0)):
            # A chosen id is checked against every session on the log, not the part read so far.
            return JSONResponse({"detail": "the proxy is still reading the sessions topic; retry shortly"},
                                status_code=503, headers={"retry-after": "2"})
        if state.registry.get(session_id) is not None:
            return _api_error(409, f"session {session_id!r} already exists")
        spec = SessionSpec(session_id=session_id, task_id=body.task_id, origin="adhoc", agent=body.agent,
                           builder=body.builder, engine=body.engine, timeout_s=body.timeout_s, api_key=api_key,
                           policy_version=body.policy_version, metadata=body.metadata)
        if (failed := await _publish(state, spec)) is not None:
            return failed
        await state.registry.apply(spec)  # read-your-writes: usable at once on this instance
        public = settings.proxy_public_url or str(request.base_url).rstrip("/")
        base = f"{public}/s/{session_id}"
        return SessionCreated(session_id=session_id, api_key=api_key,
                              base_urls={"openai": f"{base}/v1", "anthropic": base, "gemini": base})

    @app.get("/v1/sessions/{session_id}", response_model=SessionState)
    async def get_session(request: Request, session_id: str) -> SessionState | JSONResponse:
        session = state_of(request).registry.get(session_id)
        if session is None:
            return _api_error(404, f"no session {session_id!r}")
        if (refused := _session_refusal(request, settings, session)) is not None:
            return refused
        return SessionState(session_id=session_id, live=not session.ended, calls=session.next_sequence,
                            origin=session.spec.origin)

    @app.post("/v1/sessions/{session_id}/end", response_model=SessionState,
              openapi_extra={"requestBody": {"content": {"application/json": {
                  "schema": SessionEnd.model_json_schema()}}}})
    async def end_session(request: Request, session_id: str) -> SessionState | JSONResponse:
        state = state_of(request)
        session = state.registry.get(session_id)
        if session is None:
            return _api_error(404, f"no session {session_id!r}")
        if (refused := _session_refusal(request, settings, session)) is not None:
            return refused
        body = await _api_body(request, SessionEnd, empty_ok=True)
        if isinstance(body, JSONResponse):
            return body
        if session.ended:  # its outcome is on the log already: a second end must not overwrite it
            return _api_error(409, f"session {session_id!r} has already ended")
        ended = SessionEnded(session_id=session_id, task_id=session.spec.task_id, status=body.status,
                             reason=body.reason)
        if (failed := await _publish(state, ended)) is not None:
            return failed
        await state.registry.apply(ended)
        return SessionState(session_id=session_id, live=False, calls=session.next_sequence,
                            origin=session.spec.origin)

    # -- policy -------------------------------------------------------------------------------------
    @app.get("/v1/policy", response_model=PolicyState)
    async def get_policy(request: Request) -> PolicyState | JSONResponse:
        state = state_of(request)
        if (refused := _admin_refusal(request, settings)) is not None:
            return refused
        await state.policy.refresh()
        try:
            return state.policy.state(await _served_model(state))
        except ProxyError as exc:
            return _api_error(exc.status_code, exc.message)

    @app.post("/v1/policy/weights", response_model=PolicyState)
    async def update_weights(request: Request) -> PolicyState | JSONResponse:
        """Load new weights into the engine through the proxy (see proxy/policy.py); one at a time."""
        state = state_of(request)
        if (refused := _admin_refusal(request, settings)) is not None:
            return refused
        try:
            body = WeightUpdate.model_validate_json(await read_body(request, _POLICY_BODY_BYTES))
        except ValidationError as exc:
            return _api_error(422, _validation_text(exc))
        except ProxyError as exc:
            return _api_error(exc.status_code, exc.message)
        try:
            # Shielded: a trainer that hangs up mid-update must not leave the gate closed or the engine paused.
            return await asyncio.shield(state.policy.update(body))
        except ProxyError as exc:
            return _api_error(exc.status_code, exc.message)

    # -- operations ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        state = state_of(request)
        return {"status": "ok", "kafka": state.recorder.connected,
                "registry_caught_up": state.feed.caught_up.is_set(), "sessions": state.registry.counts()}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = state_of(request)
        return Response(state.metrics.render(state.registry.counts()), media_type="text/plain; version=0.0.4")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse({"detail": f"{where}: {first.get('msg')}"}, status_code=422)

    errors_by_provider = {"openai": chat.error_body, "anthropic": messages.error_body,
                          "gemini": gemini.error_body}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """No such route or method: answered in the shape of the API the path belongs to."""
        provider = _provider_for_path(request.url.path)
        if provider == "openai" and catalog.is_anthropic(request.headers):
            provider = "anthropic"  # a path both share (say /v1/models/...), asked by an Anthropic client
        if provider == "rollwire":
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        error = NotFound(f"{request.method} {request.url.path}: {exc.detail}")
        error.status_code = exc.status_code
        return JSONResponse(errors_by_provider[provider](error), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        error = as_proxy_error(exc, request.url.path)
        provider = _provider_for_path(request.url.path)
        if provider == "rollwire":
            return _api_error(500, error.message)
        render = errors_by_provider.get(provider, chat.error_body)
        return JSONResponse(render(error), status_code=500)

    return app


M = TypeVar("M", bound=BaseModel)
_SESSION_BODY_BYTES = 1024 * 1024  # a spec's metadata and engine extras; far below a Kafka record


async def _api_body(request: Request, model: type[M], *, empty_ok: bool = False) -> M | JSONResponse:
    """The request's JSON body as ``model``, read within a limit: a 413 or a 422 with its reason if not."""
    try:
        raw = await read_body(request, _SESSION_BODY_BYTES)
        return model.model_validate_json((raw or b"{}") if empty_ok else raw)
    except ValidationError as exc:
        return _api_error(422, _validation_text(exc))
    except ProxyError as exc:
        return _api_error(exc.status_code, exc.message)


async def _caught_up(state: ProxyState, wait_s: float) -> bool:
    """The registry has read the sessions topic to its end (waiting up to ``wait_s`` for it)."""
    try:
        await asyncio.wait_for(state.feed.caught_up.wait(), wait_s)
    except asyncio.TimeoutError:
        return False
    return True


async def _publish(state: ProxyState, event: SessionSpec | SessionEnded) -> JSONResponse | None:
    """Write a session event durably: a 422 if it could not be read back from the log (a value JSON or its
    consumers cannot hold), a 503 if Kafka does not take it."""
    if (reason := unreadable_reason(event)) is not None:
        return _api_error(422, f"the session's event could not be read back from the log: {reason}")
    try:
        await state.recorder.record(event)
    except CaptureFailed as exc:
        return _api_error(503, f"Kafka is unavailable, nothing was changed: {exc.message}")
    return None


def _api_error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


_POLICY_BODY_BYTES = 64 * 1024


def _is_admin(request: Request, settings: ProxySettings) -> bool:
    """The request carries the proxy's admin token (False when none is configured)."""
    token = settings.proxy_admin_token
    if not token:
        return False
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


def _admin_refusal(request: Request, settings: ProxySettings) -> JSONResponse | None:
    """A 401 unless the request carries the admin token (when one is configured); None lets it through."""
    if not settings.proxy_admin_token or _is_admin(request, settings):
        return None
    return JSONResponse({"detail": "this API needs the proxy's admin token: send "
                                   "`Authorization: Bearer <ROLLWIRE_PROXY_ADMIN_TOKEN>`"},
                        status_code=401, headers={"www-authenticate": "Bearer"})


def _session_refusal(request: Request, settings: ProxySettings, session: LiveSession) -> JSONResponse | None:
    """A 401 unless the request carries the session's own key, or the admin token: one session can never
    read or end another (ids are predictable, ``{task_id}-s{n}``; keys are not)."""
    given = _api_key(request)
    key = session.spec.api_key
    if given and key and hmac.compare_digest(given.encode(), key.encode()) or _is_admin(request, settings):
        return None
    return JSONResponse({"detail": "send the session's own API key (Authorization: Bearer, x-api-key or "
                                   "x-goog-api-key), or the proxy's admin token"},
                        status_code=401, headers={"www-authenticate": "Bearer"})


def _validation_text(exc: ValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "body: invalid request"
    return f"{'.'.join(str(p) for p in errors[0]['loc']) or 'body'}: {errors[0]['msg']}"


async def _served_model(state: ProxyState) -> str | None:
    try:
        return await state.engine.served_model()
    except ProxyError:
        return None
