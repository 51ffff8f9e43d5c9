"""What a harness's SDK asks about models besides calling one: the listings and lookups, in each
provider's shape.

- OpenAI: ``GET /v1/models`` (a list object) and ``GET /v1/models/{id}``.
- Anthropic: the same paths, told apart by the ``anthropic-version`` header every Anthropic SDK sends:
  a page of ``{"type": "model", ...}`` objects, and one such object.
- Gemini: ``GET /v1beta/models`` and ``GET /v1beta/models/{model}`` (the ``Model`` resource with its
  token limits); ``models/{model}:countTokens`` takes a ``contents`` body, or one wrapped as
  ``generateContentRequest`` (:func:`gemini_count_document`).

The proxy serves every call with the engine's model, whatever name a harness asks for. So a listing
names the engine's served model, and a lookup of any name describes that name: a harness that checks
its configured model before calling finds it. None of this is a model call, so nothing is recorded.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

OWNER = "rollwire"
# When this proxy started: what "created" says of the models it serves.
STARTED = int(time.time())
GEMINI_METHODS = ["generateContent", "streamGenerateContent", "countTokens"]


def is_anthropic(headers: Any) -> bool:
    """Whether a request on a path both APIs share comes from an Anthropic client."""
    return "anthropic-version" in headers


def is_gemini(headers: Any, query: Any) -> bool:
    """Whether a request on ``/v1/models`` comes from a Gemini client (google-genai calls v1 by default):
    its key is in ``x-goog-api-key`` or the ``key`` query parameter, never in a bearer token."""
    return ("x-goog-api-key" in headers or "key" in query) and "authorization" not in headers


def openai_model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": STARTED, "owned_by": OWNER}


def openai_models(served: str) -> dict[str, Any]:
    return {"object": "list", "data": [openai_model(served)]}


def anthropic_model(model_id: str) -> dict[str, Any]:
    created = datetime.fromtimestamp(STARTED, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": created}


def anthropic_models(served: str) -> dict[str, Any]:
    return {"data": [anthropic_model(served)], "has_more": False, "first_id": served, "last_id": served}


def listing(anthropic: bool, served: str) -> dict[str, Any]:
    """``GET /v1/models`` for an Anthropic client or an OpenAI one."""
    return anthropic_models(served) if anthropic else openai_models(served)


def lookup(anthropic: bool, model_id: str) -> dict[str, Any]:
    """``GET /v1/models/{id}`` for an Anthropic client or an OpenAI one."""
    return anthropic_model(model_id) if anthropic else openai_model(model_id)


def gemini_model(name: str, context_tokens: int | None) -> dict[str, Any]:
    """The ``Model`` resource of ``name`` (with or without its ``models/`` prefix)."""
    model = name.removeprefix("models/")
    resource: dict[str, Any] = {"name": f"models/{model}", "baseModelId": model, "version": "001",
                                "displayName": model, "description": f"served by {OWNER}",
                                "supportedGenerationMethods": GEMINI_METHODS}
    if context_tokens is not None:  # the engine's context, shared by the prompt and the reply
        resource["inputTokenLimit"] = context_tokens
        resource["outputTokenLimit"] = context_tokens
    return resource


def gemini_models(served: str, context_tokens: int | None) -> dict[str, Any]:
    return {"models": [gemini_model(served, context_tokens)]}


def gemini_count_document(document: Any) -> Any:
    """The generateContent-shaped body a ``countTokens`` body stands for: its ``generateContentRequest``
    when it has one, else the body itself (``contents``, and whatever else it carries)."""
    if isinstance(document, dict) and isinstance(document.get("generateContentRequest"), dict):
        return document["generateContentRequest"]
    return document
