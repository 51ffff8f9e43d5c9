"""The one place that bounds what the proxy reads and parses from a caller: body size, media type, JSON depth.

Everything a harness sends passes through :func:`read_json_body` before any provider module sees it, and
JSON text that arrives inside a body (tool-call arguments) is checked by :func:`check_request` once the
provider module has normalized the call. The limits:

- **Body size**: ``ROLLWIRE_PROXY_MAX_BODY_BYTES``, by default half the Kafka record limit
  (``ROLLWIRE_MAX_MESSAGE_BYTES``, 8 MiB, so 4 MiB): a call's event holds its messages (about the body's
  size) and its prompt token ids besides, so a body the record cannot hold is refused up front (413)
  rather than answered and then found unrecordable.
- **Nesting depth**: :data:`MAX_JSON_DEPTH` levels of objects and arrays. Real tool schemas nest a few
  dozen levels at most; the engine, the event encoder (orjson stops at 255) and Jinja templates fail in
  their own ways far above that, so deeper input is refused here with a 400 that names where.

The body is read in chunks and the size checked as it arrives, so a lying ``content-length`` cannot make
the proxy buffer more than the limit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from starlette.requests import Request

from schemas.completions import NormalizedRequest

from proxy.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

MAX_JSON_DEPTH = 64


def json_depth_error(document: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Where ``document`` (as a JSON decoder gives it: dicts, lists, scalars) nests deeper than
    ``max_depth`` (a dotted path), or None when it does not.

    Iterative, so that a pathological document cannot exhaust Python's own recursion limit. A first pass
    counts container levels only (no paths: this runs on every request body); the path is traced only for
    a document that is too deep.
    """
    if not _deeper_than(document, max_depth):
        return None
    stack: list[tuple[Any, int, str]] = [(document, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        children: Iterable[tuple[Any, Any]]
        if isinstance(value, dict):
            children = value.items()
        elif isinstance(value, list):
            children = enumerate(value)
        else:
            continue
        if depth > max_depth:
            return path or "(root)"
        for key, child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, f"{path}.{key}" if path else str(key)))
    return None


def _deeper_than(document: Any, max_depth: int) -> bool:
    """Whether a container nests more than ``max_depth`` levels deep (level by level, breadth first).

    Runs on every request body, so it is written for speed: exact types (what a JSON decoder gives) and
    no generator per container."""
    level: list[Any] = [document] if isinstance(document, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        below: list[Any] = []
        append = below.append
        for value in level:
            for child in (value.values() if type(value) is dict else value):
                if type(child) in _CONTAINERS:
                    append(child)
        level = below
    return False


_CONTAINERS = (dict, list)


def check_depth(document: Any, where: str = "", max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise BadRequest when ``document`` nests deeper than ``max_depth``."""
    path = json_depth_error(document, max_depth)
    if path is not None:
        at = f"{where}.{path}" if where and path != "(root)" else (where or path)
        raise BadRequest(f"JSON nested deeper than {max_depth} levels at {at}: this proxy refuses such input",
                         param=at)


def loads_bounded(text: str | bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON text from inside a request (e.g. tool-call arguments) decoded within the depth limit.

    Raises ValueError (orjson's) for text that is not JSON, BadRequest for text nested too deep.
    """
    value = orjson.loads(text)
    check_depth(value, where, max_depth)
    return value


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused (413) as soon as it is known to be over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit "
                              "(ROLLWIRE_PROXY_MAX_BODY_BYTES)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the {limit}-byte limit (ROLLWIRE_PROXY_MAX_BODY_BYTES)")
        chunks.append(chunk)
    return b"".join(chunks)


def require_json_media_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    if "json" not in content_type.lower():
        raise UnsupportedMediaType(f"send the body as application/json (got {content_type or 'no content type'!r})")


def decode_json_body(raw: bytes) -> Any:
    """The decoded body, within the depth limit; 400 for anything that is not JSON."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc).lower() or "recursion" in str(exc).lower():
            raise BadRequest(f"JSON nested deeper than {MAX_JSON_DEPTH} levels: this proxy refuses such input"
                             ) from exc
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    check_depth(document)
    return document


def check_request(request: NormalizedRequest) -> None:
    """The limits on what a normalized request carries as JSON text: tool-call arguments (the engine and
    the chat template parse them) within the depth limit. Freeform arguments (not JSON) are left alone."""
    for i, message in enumerate(request.messages):
        for j, call in enumerate(message.tool_calls):
            text = call.arguments
            if not text or text[0] not in "[{":
                continue
            where = f"messages.{i}.tool_calls.{j}.arguments"
            try:
                loads_bounded(text, where)
            except orjson.JSONDecodeError as exc:
                if "depth" in str(exc).lower() or "recursion" in str(exc).lower():  # past orjson's own limit
                    raise BadRequest(f"JSON nested deeper than {MAX_JSON_DEPTH} levels at {where}: this proxy "
                                     "refuses such input", param=where) from exc
                continue
