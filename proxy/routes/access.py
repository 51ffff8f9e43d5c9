"""Who may call what: a session's own key for its calls and its state, the admin token for the rest.

A session's key comes in whichever way its harness's SDK sends keys (``Authorization: Bearer``,
``x-api-key``, ``x-goog-api-key``, ``?key=``); the admin token only as a bearer token. Keys are compared in
constant time. One session can never read or end another: ids are predictable (``{task_id}-s{n}``), keys
are not.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from proxy.errors import ProxyError
from proxy.session_registry import LiveSession
from proxy.state import proxy_state


class AccessRefused(ProxyError):
    """The request lacks the key or token the path needs (rollwire's own API: ``{"detail": ...}``)."""

    kind, status_code = "unknown_session", 401
    headers = {"www-authenticate": "Bearer"}


def bearer_token(request: Request) -> str | None:
    """The ``Authorization: Bearer`` token, if any."""
    auth = request.headers.get("authorization", "")
    return (auth[7:].strip() or None) if auth.lower().startswith("bearer ") else None


def api_key(request: Request) -> str | None:
    """The key a harness sent, however its SDK sends it."""
    return (bearer_token(request) or request.headers.get("x-api-key") or request.headers.get("x-goog-api-key")
            or request.query_params.get("key"))


def _same(given: str | None, expected: str | None) -> bool:
    return bool(given) and bool(expected) and hmac.compare_digest(str(given).encode(), str(expected).encode())


def is_admin(request: Request) -> bool:
    """The request carries the proxy's admin token (False when none is configured)."""
    return _same(bearer_token(request), proxy_state(request).settings.proxy_admin_token)


async def call_session(request: Request, session_id: str | None = None) -> LiveSession:
    """The live session a model call (or a count, or a model listing) belongs to, by its path or its key.

    Raises :class:`~proxy.errors.UnknownSession` (the provider's 401) for a missing, unknown, ended or
    other session's key.
    """
    state = proxy_state(request)
    return await state.registry.authenticate(session_id, api_key(request), state.settings.session_wait_s)


def require_admin(request: Request) -> None:
    """Dependency of the admin API: the admin token, when one is configured; open on a development proxy."""
    if proxy_state(request).settings.proxy_admin_token and not is_admin(request):
        raise AccessRefused("this API needs the proxy's admin token: send "
                            "`Authorization: Bearer <ROLLWIRE_PROXY_ADMIN_TOKEN>`")


def require_session_key(request: Request, session: LiveSession) -> None:
    """The session's own key, or the admin token: what reading or ending a session takes."""
    if not (_same(api_key(request), session.spec.api_key) or is_admin(request)):
        raise AccessRefused("send the session's own API key (Authorization: Bearer, x-api-key or "
                            "x-goog-api-key), or the proxy's admin token")
