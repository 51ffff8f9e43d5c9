"""The session API: create a session (admin), read or end one (its own key, or admin).

A created session's spec goes onto the ``sessions`` topic before it is usable, and is applied to this
process's registry at once (read-your-writes); an end is an event too, written once: a second end is a 409
(the first one's outcome is on the log). Refusals are ``{"detail": ...}``.
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ValidationError

from proxy.errors import ApiError, CaptureFailed, ProxyError, first_error_text
from proxy.limits import read_body
from proxy.routes.access import require_admin, require_session_key
from proxy.session_registry import LiveSession
from proxy.state import ProxyState, proxy_state
from schemas.api import SessionCreate, SessionCreated, SessionEnd, SessionState
from schemas.codec import unreadable_reason
from schemas.sessions import SessionEnded, SessionSpec

router = APIRouter()

_SESSION_BODY_BYTES = 1024 * 1024  # a spec's metadata and engine extras; far below a Kafka record


def validation_text(exc: ValidationError) -> str:
    """The first field pydantic refused, as rollwire's API reports it."""
    where, message = first_error_text(exc.errors())
    return f"{where or 'body'}: {message}"


async def read_model(request: Request, model: type[BaseModel], limit: int, *, empty_ok: bool = False) -> BaseModel:
    """The request's JSON body as ``model``, read within ``limit``: an ApiError (413, 422) with its reason if not."""
    try:
        raw = await read_body(request, limit)
        return model.model_validate_json((raw or b"{}") if empty_ok else raw)
    except ValidationError as exc:
        raise ApiError(422, validation_text(exc)) from exc
    except ProxyError as exc:
        if isinstance(exc, ApiError):
            raise
        raise ApiError(exc.status_code, exc.message) from exc


async def _caught_up(state: ProxyState, wait_s: float) -> bool:
    """The registry has read the sessions topic to its end (waiting up to ``wait_s`` for it)."""
    try:
        await asyncio.wait_for(state.feed.caught_up.wait(), wait_s)
    except asyncio.TimeoutError:
        return False
    return True


async def _publish(state: ProxyState, event: SessionSpec | SessionEnded) -> None:
    """Write a session event durably: a 422 if it could not be read back from the log (a value JSON or its
    consumers cannot hold), a 503 if Kafka does not take it."""
    if (reason := unreadable_reason(event)) is not None:
        raise ApiError(422, f"the session's event could not be read back from the log: {reason}")
    try:
        await state.recorder.record(event)
    except CaptureFailed as exc:
        raise ApiError(503, f"Kafka is unavailable, nothing was changed: {exc.message}") from exc


def _known_session(request: Request, session_id: str) -> LiveSession:
    session = proxy_state(request).registry.get(session_id)
    if session is None:
        raise ApiError(404, f"no session {session_id!r}")
    require_session_key(request, session)
    return session


def _state_of(request: Request, session: LiveSession, *, live: bool) -> SessionState:
    calls = proxy_state(request).numbers.calls(session.session_id)
    return SessionState(session_id=session.session_id, live=live, calls=calls, origin=session.spec.origin)


@router.post("/v1/sessions", status_code=201, response_model=SessionCreated, dependencies=[Depends(require_admin)],
             openapi_extra={"requestBody": {"content": {"application/json": {
                 "schema": SessionCreate.model_json_schema()}}, "required": True}})
async def create_session(request: Request) -> SessionCreated:
    state = proxy_state(request)
    body = await read_model(request, SessionCreate, _SESSION_BODY_BYTES)
    assert isinstance(body, SessionCreate)
    session_id = body.session_id or f"adhoc-{secrets.token_hex(8)}"
    api_key = body.api_key or f"rw-{secrets.token_urlsafe(24)}"
    if body.session_id is not None and not await _caught_up(state, max(state.settings.session_wait_s, 10.0)):
        # A chosen id is checked against every session on the log, not the part read so far.
        raise _RetryShortly("the proxy is still reading the sessions topic; retry shortly")
    if state.registry.get(session_id) is not None:
        raise ApiError(409, f"session {session_id!r} already exists")
    spec = SessionSpec(session_id=session_id, task_id=body.task_id, origin="adhoc", agent=body.agent,
                       builder=body.builder, engine=body.engine, timeout_s=body.timeout_s, api_key=api_key,
                       policy_version=body.policy_version, metadata=body.metadata)
    await _publish(state, spec)
    await state.registry.apply(spec)  # read-your-writes: usable at once on this instance
    public = state.settings.proxy_public_url or str(request.base_url).rstrip("/")
    base = f"{public}/s/{session_id}"
    return SessionCreated(session_id=session_id, api_key=api_key,
                          base_urls={"openai": f"{base}/v1", "anthropic": base, "gemini": base})


@router.get("/v1/sessions/{session_id}", response_model=SessionState)
async def get_session(request: Request, session_id: str) -> SessionState:
    session = _known_session(request, session_id)
    return _state_of(request, session, live=not session.ended)


@router.post("/v1/sessions/{session_id}/end", response_model=SessionState,
             openapi_extra={"requestBody": {"content": {"application/json": {
                 "schema": SessionEnd.model_json_schema()}}}})
async def end_session(request: Request, session_id: str) -> SessionState:
    state = proxy_state(request)
    session = _known_session(request, session_id)
    body = await read_model(request, SessionEnd, _SESSION_BODY_BYTES, empty_ok=True)
    assert isinstance(body, SessionEnd)
    if session.ended:  # its outcome is on the log already: a second end must not overwrite it
        raise ApiError(409, f"session {session_id!r} has already ended")
    ended = SessionEnded(session_id=session_id, task_id=session.spec.task_id, status=body.status, reason=body.reason)
    await _publish(state, ended)
    await state.registry.apply(ended)
    return _state_of(request, session, live=False)


class _RetryShortly(ApiError):
    """The registry is not caught up yet: a 503 with ``retry-after``."""

    headers = {"retry-after": "2"}

    def __init__(self, message: str) -> None:
        super().__init__(503, message)
