"""What a provider API module supplies to the proxy: parsing into the internal form, replies, errors.

Each provider API (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages, Gemini) lives in a
module of its own that exposes one :class:`ProviderAdapter`. The HTTP route that serves it is the same for
all of them (``proxy.app``): read the body, resolve the session, ``parse`` the request into a
:class:`ParsedCall`, run it through :class:`~proxy.calls.CallService`, and answer with the call's
renderer, or with ``error_body`` when anything raises a :class:`~proxy.errors.ProxyError`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from proxy.turns import EngineDelta, EngineTurn
from proxy.errors import BadRequest, ProxyError, first_error_text
from proxy.limits import MAX_JSON_DEPTH, json_depth_error
from schemas.completions import NormalizedRequest, ProviderApi


logger = logging.getLogger(__name__)

WireT = TypeVar("WireT", bound=BaseModel)


def bad_request(exc: ValidationError, prefix: str = "") -> BadRequest:
    """A BadRequest naming the first field pydantic refused (``prefix``: where the validated part sits)."""
    where, message = first_error_text(exc.errors(), prefix)
    return BadRequest(f"invalid request: {where}: {message}", param=where)


def validate_body(model: type[WireT], document: Any, known_ignored: frozenset[str] | set[str] = frozenset()) -> WireT:
    """A decoded JSON body as the provider's wire ``model``; BadRequest names the first offending field.

    Top-level fields the model does not know are accepted (clients add new ones every month) and logged,
    unless ``known_ignored`` lists them as deliberately ignored.
    """
    if not isinstance(document, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        request = model.model_validate(document)
    except ValidationError as exc:
        raise bad_request(exc) from exc
    ignored = set(request.model_extra or ()) - set(known_ignored)
    if ignored:
        logger.debug("%s fields ignored: %s", model.__name__, sorted(ignored))
    return request


class Renderer(Protocol):
    """Renders one call's reply in its provider's shape, whole or as stream chunks (bytes on the wire)."""

    def response(self, turn: EngineTurn) -> dict[str, Any]:
        """The whole (non-streamed) reply body."""

    def stream_delta(self, delta: EngineDelta) -> list[bytes]:
        """Chunks for one engine delta; never the closing ones (those wait until the call is recorded)."""

    def stream_finish(self, turn: EngineTurn) -> list[bytes]:
        """The closing chunks: finish/stop reason, usage and the end marker."""

    def stream_whole(self, turn: EngineTurn) -> list[bytes]:
        """A synthetic stream for a turn the engine returned whole (opening, body and closing chunks)."""

    def stream_error(self, error: ProxyError) -> list[bytes]:
        """Chunks that tell the client the call failed after its stream had started."""


@dataclass(frozen=True)
class Route:
    """What the URL says about a call, beyond the body (Gemini puts model and streaming in the path)."""

    model: str | None = None
    stream: bool | None = None
    query: dict[str, str] = field(default_factory=dict)


@dataclass
class ParsedCall:
    """A provider request, validated and normalized, with the renderer for its reply."""

    requested_model: str | None
    request: NormalizedRequest
    renderer: Renderer

    @property
    def stream(self) -> bool:
        return self.request.stream


class ProviderAdapter(Protocol):
    """One provider API: its name in completion events, request parsing and error shape."""

    name: ProviderApi
    stream_media_type: str

    def parse(self, document: Any, route: Route) -> ParsedCall:
        """Validate and normalize a decoded JSON body; raises BadRequest naming the offending field."""

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        """The provider's error object for ``error`` (sent with ``error.status_code``)."""


ARGUMENTS_MAX_DEPTH = MAX_JSON_DEPTH // 2
"""Deepest sampled tool arguments sent as ``input``: half the body limit, leaving room for the envelope
(messages, content, block) the harness wraps them in when it sends them back."""


def arguments_object(arguments: str) -> dict[str, Any] | None:
    """The sampled tool-call ``arguments`` as a JSON object, or None when they are not one: not JSON, not
    an object, or nested deeper than :data:`ARGUMENTS_MAX_DEPTH`. Blank text is the empty object. Never
    raises. Read with orjson, so the result always serializes again (integers past 64 bits come back
    as floats; deep text is a decode error, not a RecursionError)."""
    if not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or json_depth_error(value, ARGUMENTS_MAX_DEPTH) is not None:
        return None
    return value


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error"}
_ERROR_CODES = {"unknown_session": "invalid_api_key", "context_overflow": "context_length_exceeded"}


def openai_error_body(error: ProxyError) -> dict[str, Any]:
    """OpenAI's error object (Chat Completions and Responses share it)."""
    return {"error": {"message": error.message,
                      "type": _ERROR_TYPES.get(error.status_code, "server_error" if error.status_code >= 500
                                               else "invalid_request_error"),
                      "param": error.param, "code": _ERROR_CODES.get(error.kind, error.kind)}}
