"""Anthropic Messages API (Claude Code, Pi): parsing, normalization, replies and the SSE event grammar.

Owns ``POST /v1/messages`` (Claude Code adds ``?beta=true``; the query changes nothing here) and the
prompt part of ``POST /v1/messages/count_tokens``. Wire models accept unknown fields and log them.

Choices where the Messages API and the internal form differ:

- **System prompt.** ``system`` is a string or a list of text blocks; the blocks are joined with ``"\\n"``
  into the first ``system`` message. Claude Code puts a billing line in it (a text block
  ``x-anthropic-billing-header: cc_version=…; cch=…;``, see ``CLAUDE_CODE_ATTRIBUTION_HEADER`` in
  docs/harnesses.md) whose value changes on every request; that block is **dropped**, otherwise
  no two calls of a session would share a token prefix. ``role: "system"`` messages in ``messages``
  become system messages where they stand.
- **Tool results.** A user message's ``tool_result`` blocks become ``tool`` messages (``tool_call_id`` =
  ``tool_use_id``, ``is_error`` kept; content a string or text blocks) in the order they come; the user's
  other blocks become user messages around them, so the order of the conversation is kept.
- **Thinking.** The engine's reasoning is sent as a ``thinking`` block whose ``signature`` is the
  reasoning codec's value (:mod:`proxy.apis.reasoning`): when Claude Code sends the block back, the reasoning
  is recovered from the signature exactly as the engine produced it (a client that trims or omits the
  text cannot change the prompt). A foreign signature (a real Anthropic one) falls back to the block's
  ``thinking`` text; a damaged signature of ours, or one over the codec's size limits, is a 400 naming
  it. ``redacted_thinking`` blocks carry nothing the engine can read and are dropped.
- **Deferred tools.** A tool with ``defer_loading: true`` is not in the model's context until a tool
  search loads it: it is left out of the prompt unless a ``tool_result`` of the history holds a
  ``tool_reference`` to it (rendered as ``<tool_reference>NAME</tool_reference>`` text).
  ``thinking.display: "omitted"`` (Claude Code's default) is honoured: thinking blocks then carry an
  empty text and only the signature.
- **Images and documents** are refused with a 400: the engine takes text only.
- **Accepted, not applied:** ``cache_control`` marks (the engine caches prefixes by itself),
  ``context_management`` (server-side context edits), ``metadata``, ``service_tier``, server tools with a
  ``type`` such as ``web_search_20250305`` (the engine cannot run them: dropped and logged).
  ``thinking: {type: "disabled"}`` sets the template's ``enable_thinking`` to false; ``output_config.effort``
  becomes ``reasoning_effort`` (``max`` as ``high``) and ``output_config.format`` a JSON-schema
  ``response_format``. ``tool_choice`` maps to OpenAI's: auto → ``auto``, any → ``required``, tool →
  the named function, none → ``none``.
- **Content blocks** are objects whose ``type`` is a string (else a 400 naming the block); so are the
  ids and names the request uses as keys.
- **Tool-use input** that comes back is serialized with ``json.dumps`` (``", "`` and ``": "``, keys in
  the client's order), the layout in which vLLM's hermes parser hands arguments out: a model that
  samples that layout finds its own bytes in the next prompt.
- **Sampled arguments** that are not a JSON object, or that nest deeper than
  :data:`ARGUMENTS_MAX_DEPTH` levels, are sent as ``input: {}`` (and logged): ``input`` must be an object,
  and a deeper one would come back in the next request's history and be refused there by the proxy's
  body-depth limit. The completion event keeps the arguments as sampled.
- **Replies.** ``tool_use`` ids are the engine's tool-call ids (so the next call's ``tool_result``
  names the id in the completion event). ``stop_reason``: ``tool_use`` when the turn called tools,
  ``max_tokens`` on the length limit, ``stop_sequence`` (and ``stop_sequence`` the string) when vLLM
  stopped on a stop string, else ``end_turn``. The stream always has ``event:`` lines
  (Claude Code silently re-sends the request without streaming otherwise) and stops every content
  block before ``message_delta``; the closing part (the last ``content_block_stop``, ``message_delta``
  with stop reason and usage, ``message_stop``) is sent only once the call is recorded.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.turns import EngineDelta, EngineTurn, ToolCallDelta
from proxy.errors import BadRequest, ProxyError
from proxy.apis.base import ARGUMENTS_MAX_DEPTH, arguments_object, ParsedCall, Route, bad_request, validate_body
from proxy.apis.reasoning import ReasoningBudget, decode_reasoning, encode_reasoning
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

_KNOWN_IGNORED = {"metadata", "context_management", "service_tier", "container", "mcp_servers", "betas",
                  "diagnostics"}
BILLING_PREFIX = "x-anthropic-billing-header:"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- wire models ---------------------------------------------------------------------------------------

class BlockHead(_Wire):
    """Any content block, before its kind is known: an object whose ``type`` is a string."""

    type: str


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] | str | None = None


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Any] | None = None
    is_error: bool | None = None


class ToolReferenceBlock(_Wire):
    type: Literal["tool_reference"]
    tool_name: str


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class WireMessage(_Wire):
    role: Literal["user", "assistant", "system"]
    content: str | list[Any]  # blocks: objects with a string type, checked one by one (_block_type)


class WireTool(_Wire):
    name: str = Field(min_length=1)
    type: str | None = None
    defer_loading: bool | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputConfig(_Wire):
    effort: str | None = None
    format: dict[str, Any] | None = None


class MessagesRequest(_Wire):
    """POST /v1/messages (and, without ``max_tokens``, /v1/messages/count_tokens), as far as we read it."""

    model: str | None = None
    messages: list[WireMessage] = Field(min_length=1)
    system: str | list[Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    tools: list[WireTool] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


def parse_request(document: Any, *, need_max_tokens: bool) -> MessagesRequest:
    """Validate a decoded JSON body; BadRequest names the first offending field."""
    request = validate_body(MessagesRequest, document, _KNOWN_IGNORED)
    if need_max_tokens and request.max_tokens is None:
        raise BadRequest("invalid request: max_tokens: Field required", param="max_tokens")
    return request


# -- normalization -------------------------------------------------------------------------------------

_NOT_TEXT = {"image", "document", "search_result", "container_upload"}


def _block(model: type[_Wire], block: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(block)
    except ValidationError as exc:
        raise bad_request(exc, where) from exc


def _block_type(block: Any, where: str) -> str:
    """A content block's ``type``; a 400 naming the block when it is not an object with a string type."""
    if not isinstance(block, dict):
        raise BadRequest(f"{where}: a content block must be an object", param=where)
    return _block(BlockHead, block, where).type


def _refuse(kind: str, where: str) -> BadRequest:
    if kind in _NOT_TEXT:
        return BadRequest(f"{where}: {kind} blocks are not supported: this engine takes text only "
                          "(remove the attachment)", param=where)
    return BadRequest(f"{where}: unsupported content block type {kind!r}", param=where)


def _text_parts(blocks: list[Any], where: str, *, references: bool = False) -> list[ContentPart]:
    parts = []
    for j, block in enumerate(blocks):
        here = f"{where}.{j}"
        kind = _block_type(block, here)
        if references and kind == "tool_reference":
            name = _block(ToolReferenceBlock, block, here).tool_name
            parts.append(ContentPart(type="text", text=f"<tool_reference>{name}</tool_reference>"))
        elif kind == "text":
            parts.append(ContentPart(type="text", text=_block(TextBlock, block, here).text))
        else:
            raise _refuse(kind, here)
    return parts


def _referenced_tools(request: MessagesRequest) -> set[str]:
    """Names of deferred tools a tool search loaded: ``tool_reference`` blocks in tool results."""
    names: set[str] = set()
    for message in request.messages:
        for block in message.content if isinstance(message.content, list) else ():
            if not isinstance(block, dict) or block.get("type") != "tool_result":
                continue
            if isinstance(block.get("content"), list):
                names.update(part["tool_name"] for part in block["content"]
                             if isinstance(part, dict) and part.get("type") == "tool_reference"
                             and isinstance(part.get("tool_name"), str))
    return names


def system_text(system: str | list[Any] | None) -> str | None:
    """The system prompt as one string, without Claude Code's per-request billing line."""
    if system is None or isinstance(system, str):
        return system
    texts = [part.text or "" for part in _text_parts(system, "system")]
    kept = [text for text in texts if not text.lstrip().startswith(BILLING_PREFIX)]
    return "\n".join(kept) if kept else None


def _tool_result(block: ToolResultBlock, where: str) -> ChatMessage:
    content = block.content
    if isinstance(content, list):
        parts = _text_parts(content, f"{where}.content", references=True)
        content = parts[0].text if len(parts) == 1 else (parts or "")
    return ChatMessage(role="tool", content=content if content is not None else "", tool_call_id=block.tool_use_id,
                       is_error=block.is_error)


def _user_messages(content: list[Any], where: str) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    pending: list[ContentPart] = []

    def flush() -> None:
        if pending:
            messages.append(ChatMessage(role="user", content=list(pending)))
            pending.clear()

    for j, block in enumerate(content):
        here = f"{where}.{j}"
        kind = _block_type(block, here)
        if kind == "tool_result":
            flush()
            messages.append(_tool_result(_block(ToolResultBlock, block, here), here))
        elif kind == "text":
            pending.append(ContentPart(type="text", text=_block(TextBlock, block, here).text))
        else:
            raise _refuse(kind, here)
    flush()
    return messages


def _arguments(value: dict[str, Any] | str | None) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value or {}, ensure_ascii=False)


def _assistant_message(content: list[Any], where: str, budget: ReasoningBudget) -> ChatMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        here = f"{where}.{j}"
        kind = _block_type(block, here)
        if kind == "text":
            texts.append(_block(TextBlock, block, here).text)
        elif kind == "thinking":
            thinking = _block(ThinkingBlock, block, here)
            recovered = None
            if thinking.signature:
                recovered = decode_reasoning(thinking.signature, param=f"{here}.signature", budget=budget)
            thoughts.append(recovered if recovered is not None else thinking.thinking)
        elif kind == "redacted_thinking":
            continue  # opaque: nothing the engine can read
        elif kind == "tool_use":
            use = _block(ToolUseBlock, block, here)
            calls.append(ToolCall(id=use.id, name=use.name, arguments=_arguments(use.input)))
        else:
            raise _refuse(kind, here)
    if not texts:
        text: str | list[ContentPart] | None = None
    elif len(texts) == 1:
        text = texts[0]
    else:
        text = [ContentPart(type="text", text=t) for t in texts]
    return ChatMessage(role="assistant", content=text, reasoning="".join(thoughts) or None, tool_calls=calls)


def _messages(request: MessagesRequest) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    budget = ReasoningBudget()  # one per request: all its signatures together inflate within REQUEST_LIMIT
    system = system_text(request.system)
    if system is not None:
        messages.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(request.messages):
        where = f"messages.{i}.content"
        if message.role == "system":
            content = message.content
            text = content if isinstance(content, str) else "\n".join(p.text or "" for p in _text_parts(content, where))
            messages.append(ChatMessage(role="system", content=text))
        elif isinstance(message.content, str):
            messages.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            messages.append(_assistant_message(message.content, where, budget))
        else:
            messages.extend(_user_messages(message.content, where))
    return messages


def _tools(request: MessagesRequest) -> list[ToolDefinition]:
    tools = []
    loaded = _referenced_tools(request) if any(t.defer_loading for t in request.tools or ()) else set()
    for tool in request.tools or ():
        if tool.type not in (None, "custom"):
            logger.info("server tool %r (%s) dropped: the engine cannot run it", tool.name, tool.type)
            continue
        if tool.defer_loading and tool.name not in loaded:
            continue  # not in the model's context until a tool search returns a reference to it
        tools.append(ToolDefinition(name=tool.name, description=tool.description, parameters=tool.input_schema))
    return tools


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise BadRequest("tool_choice of type 'tool' needs a name", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


def _response_format(config: OutputConfig | None) -> dict[str, Any] | None:
    if config is None or not config.format:
        return None
    if config.format.get("type") != "json_schema" or not isinstance(config.format.get("schema"), dict):
        raise BadRequest("output_config.format: only {type: 'json_schema', schema: {...}} is supported",
                         param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": config.format["schema"]}}


def normalize(request: MessagesRequest) -> NormalizedRequest:
    """The internal request form of a Messages request."""
    extra: dict[str, Any] = {}
    if (response_format := _response_format(request.output_config)) is not None:
        extra["response_format"] = response_format
    effort = request.output_config.effort if request.output_config else None
    disabled = request.thinking is not None and request.thinking.type == "disabled"
    return NormalizedRequest(
        messages=_messages(request),
        tools=_tools(request),
        tool_choice=_tool_choice(request.tool_choice),
        sampling=SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                                max_tokens=request.max_tokens, stop=list(request.stop_sequences or ()),
                                extra=extra),
        stream=request.stream,
        reasoning_effort=_EFFORTS.get(effort) if effort else None,
        chat_template_kwargs={"enable_thinking": False} if disabled else {},
    )


# -- replies -------------------------------------------------------------------------------------------

def _stop_reason(turn: EngineTurn) -> str:
    if turn.tool_calls or turn.finish_reason == "tool_calls":
        return "tool_use"
    if turn.finish_reason == "length":
        return "max_tokens"
    if _stop_sequence(turn) is not None:
        return "stop_sequence"
    return "end_turn"


def _stop_sequence(turn: EngineTurn) -> str | None:
    """The stop string the turn ended on (vLLM names it in ``stop_reason``; an id there is an end token)."""
    if turn.tool_calls or turn.finish_reason != "stop" or not isinstance(turn.stop_reason, str):
        return None
    return turn.stop_reason


def _usage(turn: EngineTurn) -> dict[str, int]:
    u = turn.usage
    cached = u.cached_tokens or 0
    return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the ``input`` object; anything :func:`arguments_object` cannot turn
    into one becomes ``{}`` (the event keeps the text as sampled)."""
    value = arguments_object(arguments)
    if value is None:
        logger.warning("tool call arguments are not a JSON object within %d levels; sent as {}: %.200s",
                       ARGUMENTS_MAX_DEPTH, arguments)
        return {}
    return value


def _sse(event: str, document: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(document) + b"\n\n"


class MessagesRenderer:
    """Renders one call's reply, whole or as the Messages SSE grammar, with its content-block state."""

    def __init__(self, request: MessagesRequest) -> None:
        self.model = request.model or "rollwire"
        # display "omitted": thinking blocks carry only the signature (the text stays recoverable from it)
        self.show_thinking = not (request.thinking is not None and request.thinking.display == "omitted")
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._started = False
        self._index = -1  # index of the last block opened
        self._open: str | None = None  # kind of the open block: thinking, text, tool_use
        self._open_call: int | None = None  # engine index of the open tool_use block
        self._reasoning: list[str] = []  # reasoning of the open thinking block

    # whole ------------------------------------------------------------------------------------------
    def response(self, turn: EngineTurn) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if turn.reasoning:
            content.append({"type": "thinking", "thinking": turn.reasoning if self.show_thinking else "",
                            "signature": encode_reasoning(turn.reasoning)})
        if turn.content:
            content.append({"type": "text", "text": turn.content})
        for call in turn.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": _stop_reason(turn), "stop_sequence": _stop_sequence(turn), "usage": _usage(turn)}

    # stream -----------------------------------------------------------------------------------------
    def _start(self, input_tokens: int) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0}}
        return [_sse("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        chunks = []
        if self._open == "thinking":
            signature = encode_reasoning("".join(self._reasoning))
            chunks.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                       "delta": {"type": "signature_delta", "signature": signature}}))
            self._reasoning = []
        chunks.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._open, self._open_call = None, None
        return chunks

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        chunks = self._close()
        self._index += 1
        self._open = kind
        chunks.append(_sse("content_block_start", {"type": "content_block_start", "index": self._index,
                                                   "content_block": block}))
        return chunks

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _tool_call(self, call: ToolCallDelta) -> list[bytes]:
        chunks: list[bytes] = []
        if call.id or call.name:
            if self._open == "tool_use" and self._open_call == call.index:
                pass  # a repeated header for the open call
            else:
                chunks += self._open_block("tool_use", {"type": "tool_use", "id": call.id or f"call_{call.index}",
                                                        "name": call.name or "", "input": {}})
                self._open_call = call.index
        if call.arguments:
            if self._open == "tool_use" and self._open_call == call.index:
                chunks.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            else:
                logger.warning("arguments for tool call %d arrived after its block closed; not streamed", call.index)
        return chunks

    def stream_delta(self, delta: EngineDelta) -> list[bytes]:
        """Chunks for one engine delta: message_start first, then blocks opened, filled and stopped as the
        kind of output changes. The open block stays open (its stop may be the closing part)."""
        chunks = self._start(delta.prompt_length)
        if delta.reasoning:
            if self._open != "thinking":
                chunks += self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._reasoning.append(delta.reasoning)
            if self.show_thinking:
                chunks.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self._open != "text":
                chunks += self._open_block("text", {"type": "text", "text": ""})
            chunks.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            chunks += self._tool_call(call)
        return chunks

    def stream_finish(self, turn: EngineTurn) -> list[bytes]:
        """The closing part: the open block's stop, message_delta (stop reason, usage), message_stop."""
        chunks = self._start(len(turn.prompt_token_ids)) + self._close()
        usage = _usage(turn)
        chunks.append(_sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": _stop_reason(turn),
                                                       "stop_sequence": _stop_sequence(turn)},
                                             "usage": {"output_tokens": usage["output_tokens"],
                                                       "input_tokens": usage["input_tokens"],
                                                       "cache_read_input_tokens": usage["cache_read_input_tokens"],
                                                       "cache_creation_input_tokens": 0}}))
        chunks.append(_sse("message_stop", {"type": "message_stop"}))
        return chunks

    def stream_whole(self, turn: EngineTurn) -> list[bytes]:
        """A synthetic stream for a turn the engine returned whole."""
        chunks = self.stream_delta(EngineDelta(reasoning=turn.reasoning, content=turn.content,
                                               prompt_token_ids=turn.prompt_token_ids))
        if turn.tool_calls:
            calls = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(turn.tool_calls)]
            chunks += self.stream_delta(EngineDelta(tool_calls=calls))
        return chunks + self.stream_finish(turn)

    def stream_error(self, error: ProxyError) -> list[bytes]:
        return [_sse("error", error_body(error))]


# -- errors --------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                426: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error", 529: "overloaded_error"}


def error_body(error: ProxyError) -> dict[str, Any]:
    """Anthropic's error object. A context overflow says "prompt is too long", the phrase Claude Code
    looks for to compact its history."""
    message = error.message
    if error.kind == "context_overflow":
        message = f"prompt is too long: {message}"
    kind = _ERROR_TYPES.get(error.status_code, "api_error" if error.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesApi:
    """``POST /v1/messages`` (and ``/v1/messages/count_tokens``)."""

    name: ProviderApi = "anthropic.messages"
    stream_media_type = "text/event-stream"

    def parse(self, document: Any, route: Route) -> ParsedCall:
        wire = parse_request(document, need_max_tokens=True)
        return ParsedCall(requested_model=wire.model, request=normalize(wire), renderer=MessagesRenderer(wire))

    def parse_count(self, document: Any) -> NormalizedRequest:
        """The prompt of a ``count_tokens`` body (a Messages body without ``max_tokens``), normalized."""
        return normalize(parse_request(document, need_max_tokens=False))

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        return error_body(error)
