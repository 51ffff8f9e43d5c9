"""OpenAI Chat Completions as harnesses speak it (Qwen Code, Pi, …): parsing, normalization, replies.

Wire models accept unknown fields (clients add new ones all the time) and log what they ignore. The
reply and the stream are re-rendered from the engine's output: the requested model name is restored,
vLLM's token fields are dropped (the harness did not ask for them), and every stream ends with a chunk
that carries ``finish_reason`` (clients silently fail without one).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.turns import EngineDelta, EngineTurn, ToolCallDelta
from proxy.errors import BadRequest, ProxyError
from proxy.apis.base import openai_error_body as error_body, ParsedCall, Route, validate_body
from proxy.apis.token_entries import checked_top_logprobs, openai_entries
from schemas.completions import (
    ChatMessage,
    ContentPart,
    NormalizedRequest,
    ProviderApi,
    SamplingParams,
    ToolCall,
    ToolDefinition,
)

logger = logging.getLogger(__name__)

_KNOWN_IGNORED = {"user", "store", "metadata", "parallel_tool_calls", "service_tier", "prediction",
                  "modalities", "audio", "logit_bias", "stream_options", "n"}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class WireFunction(_Wire):
    name: str
    arguments: str | dict[str, Any] = ""


class WireToolCall(_Wire):
    id: str | None = None
    type: str = "function"
    function: WireFunction


class WireMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[WireToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # not in OpenAI's spec: DeepSeek/Qwen echo reasoning back here
    reasoning: str | None = None  # not in OpenAI's spec: vLLM's name for the same


class WireToolFunction(_Wire):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class WireTool(_Wire):
    type: str = "function"
    function: WireToolFunction


class StreamOptions(_Wire):
    include_usage: bool = False


class ChatCompletionRequest(_Wire):
    """POST /v1/chat/completions, as far as we read it."""

    model: str | None = None
    messages: list[WireMessage] = Field(min_length=1)
    tools: list[WireTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    top_k: int | None = None  # not in OpenAI's spec: vLLM's
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    reasoning_effort: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # not in OpenAI's spec: vLLM's
    response_format: dict[str, Any] | None = None  # structured output: passed to the engine as is

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported: each sample is its own session")
        return value


def parse_request(document: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body; BadRequest names the first offending field."""
    return validate_body(ChatCompletionRequest, document, _KNOWN_IGNORED)


def _content(content: str | list[dict[str, Any]] | None, where: str) -> str | list[ContentPart] | None:
    if content is None or isinstance(content, str):
        return content
    parts: list[ContentPart] = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            parts.append(ContentPart(type="text", text=part["text"]))
        elif kind == "image_url":
            url = part.get("image_url")
            parts.append(ContentPart(type="image", data=url.get("url") if isinstance(url, dict) else url))
        else:
            raise BadRequest(f"unsupported content part type {kind!r}", param=f"{where}.content.{i}")
    return parts


def _arguments(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _engine_extras(request: ChatCompletionRequest) -> dict[str, Any]:
    """What the request asks of the engine beyond the common sampling fields: a structured output, and
    the alternatives per token of a harness that asked for logprobs with ``top_logprobs``."""
    extras: dict[str, Any] = {}
    if request.response_format and request.response_format.get("type") != "text":
        extras["response_format"] = request.response_format
    top = checked_top_logprobs(request.top_logprobs, "top_logprobs")
    if top and not request.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if top:
        extras["top_logprobs"] = top
    return extras


def normalize(request: ChatCompletionRequest) -> NormalizedRequest:
    """The internal request form of a chat completion request."""
    messages = []
    for i, m in enumerate(request.messages):
        calls = [ToolCall(id=c.id or f"call_{i}_{j}", name=c.function.name, arguments=_arguments(c.function.arguments))
                 for j, c in enumerate(m.tool_calls or ())]
        if m.role == "tool" and m.tool_call_id is None:
            raise BadRequest("a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
        messages.append(ChatMessage(role=m.role, content=_content(m.content, f"messages.{i}"),
                                    reasoning=m.reasoning_content or m.reasoning, tool_calls=calls,
                                    tool_call_id=m.tool_call_id, name=m.name))
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or ())
    return NormalizedRequest(
        messages=messages,
        tools=[ToolDefinition(name=t.function.name, description=t.function.description,
                              parameters=t.function.parameters) for t in request.tools or ()],
        tool_choice=request.tool_choice,
        sampling=SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                                max_tokens=request.max_completion_tokens or request.max_tokens, seed=request.seed,
                                stop=stop, presence_penalty=request.presence_penalty,
                                frequency_penalty=request.frequency_penalty,
                                extra=_engine_extras(request)),
        stream=request.stream,
        reasoning_effort=request.reasoning_effort,
        chat_template_kwargs=request.chat_template_kwargs or {},
    )


def _message(turn: EngineTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in turn.tool_calls]
    return message


def _usage(turn: EngineTurn) -> dict[str, int]:
    u = turn.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _logprobs_block(values: list[float | None], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``logprobs`` of a choice: the engine's entries where it gave one per token, else the values alone."""
    return {"content": openai_entries(values, entries)}


class ChatRenderer:
    """Renders one call's reply, whole or streamed, in the Chat Completions shape."""

    def __init__(self, request: ChatCompletionRequest) -> None:
        self.model = request.model or "rollwire"
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.logprobs = request.logprobs
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sent_role = False

    def response(self, turn: EngineTurn) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": _message(turn), "finish_reason": turn.finish_reason or "stop",
                                  "logprobs": _logprobs_block(turn.logprobs, turn.logprob_entries) if self.logprobs
                                  else None}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": _usage(turn)}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[float | None] | None = None, entries: list[dict[str, Any]] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if self.logprobs and logprobs:
            choice["logprobs"] = _logprobs_block(logprobs, entries or [])
        return _sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "choices": [choice]})

    def stream_delta(self, delta: EngineDelta) -> list[bytes]:
        """Chunks for one engine delta, without its finish_reason (that waits for the capture)."""
        if not delta.has_text and not (self.logprobs and delta.logprobs):
            return []
        out: dict[str, Any] = {}
        if not self._sent_role:
            out["role"] = "assistant"
            self._sent_role = True
        if delta.content:
            out["content"] = delta.content
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            out["tool_calls"] = []
            for call in delta.tool_calls:
                part: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
                if call.id:
                    part["id"], part["type"] = call.id, "function"
                if call.name:
                    part["function"]["name"] = call.name
                out["tool_calls"].append(part)
        return [self._chunk(out, logprobs=delta.logprobs, entries=delta.logprob_entries)]

    def stream_finish(self, turn: EngineTurn) -> list[bytes]:
        """The closing chunks: finish_reason, usage if asked for, and [DONE]."""
        first = {} if self._sent_role else {"role": "assistant", "content": ""}
        chunks = [self._chunk(first, finish_reason=turn.finish_reason or "stop")]
        if self.include_usage:
            chunks.append(_sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "choices": [], "usage": _usage(turn)}))
        chunks.append(b"data: [DONE]\n\n")
        return chunks

    def stream_whole(self, turn: EngineTurn) -> list[bytes]:
        """A synthetic stream for a turn the engine returned whole."""
        delta = EngineDelta(content=turn.content, reasoning=turn.reasoning, logprobs=turn.logprobs,
                            logprob_entries=turn.logprob_entries, tool_calls=[])
        chunks = self.stream_delta(delta)
        if turn.tool_calls:
            calls = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(turn.tool_calls)]
            chunks += self.stream_delta(EngineDelta(tool_calls=calls))
        return chunks + self.stream_finish(turn)

    def stream_error(self, error: ProxyError) -> list[bytes]:
        return [_sse(error_body(error))]


def _sse(document: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(document) + b"\n\n"


class ChatCompletionsApi:
    """``POST /v1/chat/completions``."""

    name: ProviderApi = "openai.chat"
    stream_media_type = "text/event-stream"

    def parse(self, document: Any, route: Route) -> ParsedCall:
        wire = parse_request(document)
        return ParsedCall(requested_model=wire.model, request=normalize(wire), renderer=ChatRenderer(wire))

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        return error_body(error)
