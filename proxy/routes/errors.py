"""Errors that leave a route, or never reach one, answered in the protocol of the API the path belongs to.

Provider paths get their provider's error object (OpenAI's, Anthropic's or Gemini's; a path OpenAI and
Anthropic share is answered in the shape its asker's headers tell), unknown paths and methods under them
included; rollwire's own API (sessions, policy) gets ``{"detail": ...}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.apis import model_catalog as catalog
from proxy.errors import NotFound, ProxyError, as_proxy_error, first_error_text
from proxy.routes.calls import chat, gemini, messages

Family = Literal["openai", "anthropic", "gemini", "rollwire"]

_ERROR_BODIES: dict[str, Callable[[ProxyError], dict[str, Any]]] = {
    "openai": chat.error_body, "anthropic": messages.error_body, "gemini": gemini.error_body}


def api_family(request: Request) -> Family:
    """Which API a path belongs to, for answering errors in its shape."""
    path = request.url.path
    if "/v1beta/" in path or "/v1alpha/" in path or ("/v1/models/" in path and ":" in path.rpartition("/")[2]):
        return "gemini"
    if "/v1/messages" in path:
        return "anthropic"
    if path.startswith(("/v1/sessions", "/v1/policy", "/v1/engines")):
        return "rollwire"
    if catalog.is_anthropic(request.headers):
        return "anthropic"  # a path both share (say /v1/models/...), asked by an Anthropic client
    return "openai"


def _answer(request: Request, error: ProxyError, status: int,
            headers: Mapping[str, str] | None = None) -> JSONResponse:
    family = api_family(request)
    body = {"detail": error.message} if family == "rollwire" else _ERROR_BODIES[family](error)
    return JSONResponse(body, status_code=status, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    where, message = first_error_text(exc.errors())
    return JSONResponse({"detail": f"{where}: {message}"}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> Response:
    """No such route or method."""
    assert isinstance(exc, StarletteHTTPException)
    if api_family(request) == "rollwire":
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
    error = NotFound(f"{request.method} {request.url.path}: {exc.detail}")
    error.status_code = exc.status_code
    return _answer(request, error, exc.status_code, exc.headers)


async def _proxy_error(request: Request, exc: Exception) -> Response:
    """A refusal raised by a route or a dependency (the admin token, a session's key, a bad body)."""
    assert isinstance(exc, ProxyError)
    return _answer(request, exc, exc.status_code, getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> Response:
    return _answer(request, as_proxy_error(exc, request.url.path), 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ProxyError, _proxy_error)
    app.add_exception_handler(Exception, _unexpected)
