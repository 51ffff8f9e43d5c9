"""OpenAI Responses API (Codex CLI, Pi): parsing, normalization, replies and the SSE event sequence.

SKELETON: to be written (issue 4).
"""

from __future__ import annotations

from typing import Any

from proxy.errors import ProxyError
from proxy.openai_chat import error_body as openai_error_body
from proxy.providers import ParsedCall, Route


class ResponsesApi:
    """``POST /v1/responses``."""

    name = "openai.responses"
    stream_media_type = "text/event-stream"

    def parse(self, document: Any, route: Route) -> ParsedCall:
        raise NotImplementedError

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        return openai_error_body(error)
