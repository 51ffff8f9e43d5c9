"""Model listings in each provider's shape: not model calls, nothing recorded.

OpenAI and Anthropic share ``/v1/models``: the asker's shape is told by its headers (``anthropic-version``),
Gemini's by its key's place (``x-goog-api-key`` or ``?key=``); ``/v1beta/models`` is Gemini's own. Every
name asked for is served by the engine's one model (:mod:`proxy.apis.model_catalog`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from proxy.apis import model_catalog as catalog
from proxy.errors import MethodNotAllowed, ProxyError, as_proxy_error
from proxy.routes.access import call_session
from proxy.routes.calls import chat, gemini, messages
from proxy.state import proxy_state

router = APIRouter()


async def _describe(request: Request, session_id: str | None, error_body: Callable[[ProxyError], dict[str, Any]],
                    answer: Callable[[str, int | None], dict[str, Any]]) -> Response:
    state = proxy_state(request)
    try:
        await call_session(request, session_id)
        served = await state.engine.served_model()
    except Exception as exc:
        error = as_proxy_error(exc, request.url.path)
        return JSONResponse(error_body(error), status_code=error.status_code)
    return JSONResponse(answer(served, state.engine.max_model_len))


async def _shared_path(request: Request, session_id: str | None,
                       answer: Callable[[bool, str], dict[str, Any]]) -> Response:
    anthropic = catalog.is_anthropic(request.headers)
    return await _describe(request, session_id, messages.error_body if anthropic else chat.error_body,
                           lambda served, _: answer(anthropic, served))


@router.get("/v1/models")
async def list_models(request: Request, session_id: str | None = None) -> Response:
    if catalog.is_gemini(request.headers, request.query_params):
        return await gemini_models(request, session_id)
    return await _shared_path(request, session_id, catalog.listing)


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str, session_id: str | None = None) -> Response:
    if catalog.is_gemini(request.headers, request.query_params):
        return await gemini_model(request, model_id, session_id)
    return await _shared_path(request, session_id, lambda anthropic, _: catalog.lookup(anthropic, model_id))


@router.get("/v1beta/models")
async def gemini_models(request: Request, session_id: str | None = None) -> Response:
    return await _describe(request, session_id, gemini.error_body, catalog.gemini_models)


@router.get("/v1beta/models/{target:path}")
async def gemini_model(request: Request, target: str, session_id: str | None = None) -> Response:
    if ":" in target:
        error = MethodNotAllowed(f"GET {request.url.path}: Gemini's methods are POSTed")
        return JSONResponse(gemini.error_body(error), status_code=error.status_code)
    return await _describe(request, session_id, gemini.error_body,
                           lambda _, context: catalog.gemini_model(target, context))
