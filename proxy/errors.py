"""Exceptions raised while serving a model call; each provider's handler renders them in its own shape.

Every error names the ``CallError.kind`` recorded in the completion event and the HTTP status the
harness sees. Retryable ones (engine down, capture failed) use 5xx so that SDKs retry them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from schemas.completions import CallError, CallErrorKind

logger = logging.getLogger(__name__)


class ProxyError(Exception):
    """Base class: a model call that cannot be served as asked."""

    kind: CallErrorKind = "internal"
    status_code: int = 500
    param: str | None = None
    #: set once a failed-call event for this error has been written (or tried): never recorded twice
    recorded: bool = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param

    def call_error(self) -> CallError:
        return CallError(kind=self.kind, message=self.message, http_status=self.status_code)


class BadRequest(ProxyError):
    """The request is malformed or asks for something unsupported."""

    kind: CallErrorKind = "bad_request"  # declared again: subclasses name other kinds
    status_code = 400


class PayloadTooLarge(BadRequest):
    """The request body is over the configured limit, or the call is too large to record."""

    kind, status_code = "payload_too_large", 413


class UnsupportedMediaType(BadRequest):
    """The request body is not JSON."""

    status_code = 415


class NotFound(BadRequest):
    """The path names no method of the provider API."""

    status_code = 404


class MethodNotAllowed(BadRequest):
    """The path exists, but not for this method (Gemini's methods are POSTed)."""

    status_code = 405


class UpgradeRequired(BadRequest):
    """The client asked for a protocol this route does not speak (a WebSocket upgrade)."""

    status_code = 426


class UnknownSession(ProxyError):
    """The path or key names no registered, live session."""

    kind, status_code = "unknown_session", 401


class ContextOverflow(ProxyError):
    """The prompt plus the requested tokens exceed the engine's context window."""

    kind, status_code = "context_overflow", 400


class EngineUnavailable(ProxyError):
    """The engine cannot be reached."""

    kind, status_code = "engine_unavailable", 503


class EngineTimeout(ProxyError):
    """The engine did not answer in time."""

    kind, status_code = "engine_timeout", 504


class EngineFailed(ProxyError):
    """The engine answered with an error or with something unusable."""

    kind, status_code = "engine_error", 502


class EngineConnectionLost(EngineFailed):
    """The connection to the engine broke (reset, closed) without an HTTP answer."""


class CaptureFailed(ProxyError):
    """The completion event could not be recorded, so the reply is withheld (retryable)."""

    kind, status_code = "capture_failed", 503


class ClientDisconnected(ProxyError):
    """The harness went away before the reply was complete (recorded, never sent)."""

    kind, status_code = "client_disconnected", 499


class ProxyStopped(ProxyError):
    """The proxy was stopping and cut the call at the end of its shutdown grace (recorded, never sent)."""

    kind, status_code = "proxy_stopped", 503


class PolicyNotReady(EngineUnavailable):
    """The session asks for a newer policy version than the engine serves, and none came in time."""


class PolicyError(ProxyError):
    """A weight update (``POST /v1/policy/weights``) that cannot be done; answered on rollwire's own API."""


class PolicyConflict(PolicyError):
    """Another update is in progress, or the version asked for is not newer than the one serving."""

    kind, status_code = "bad_request", 409


class CheckpointRefused(PolicyError):
    """The checkpoint would not load correctly into this engine (the message says what to change)."""

    kind, status_code = "bad_request", 422


class DrainTimeout(PolicyError):
    """Calls in flight did not finish on the old weights within the update's drain timeout."""

    kind, status_code = "engine_timeout", 504


class WeightApiMissing(PolicyError):
    """The engine serves no weight endpoints (vLLM registers them only with ``VLLM_SERVER_DEV_MODE=1``)."""

    kind, status_code = "engine_unavailable", 503


class WeightUpdateFailed(PolicyError):
    """The engine failed a step of the update; its message is kept."""

    kind, status_code = "engine_error", 502


class UnrecordableEvent(ProxyError):
    """The call's event cannot be written as it is (over the record limit, or not encodable); not retryable.

    The caller records a slimmed failed-call event instead (tokens kept, request dropped)."""

    kind, status_code = "payload_too_large", 413


class ApiError(ProxyError):
    """A refusal of rollwire's own API (sessions, policy), answered as ``{"detail": message}``."""

    kind = "bad_request"

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code


def first_error_text(errors: Sequence[Mapping[str, Any]], prefix: str = "") -> tuple[str, str]:
    """Where the first of pydantic's (or FastAPI's) validation errors is, dotted ("" for the whole body), and
    what it says."""
    if not errors:
        return prefix, "invalid request"
    first = errors[0]
    where = ".".join(str(part) for part in (*([prefix] if prefix else []), *first.get("loc", ())))
    return where, str(first.get("msg", "invalid"))


def as_proxy_error(exc: BaseException, where: str = "") -> ProxyError:
    """``exc`` as the ProxyError to answer and record; anything else is a bug of ours: logged with its
    traceback, and still answered in the caller's protocol (a 500 without a traceback) and recorded."""
    if isinstance(exc, ProxyError):
        return exc
    logger.error("unhandled error%s", f" on {where}" if where else "", exc_info=exc)
    return ProxyError(f"internal proxy error ({type(exc).__name__}); see the proxy log")
