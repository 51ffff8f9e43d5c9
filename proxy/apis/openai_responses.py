"""OpenAI Responses API as harnesses speak it (Codex CLI, Pi): parsing, normalization, replies and SSE events.

Requests: ``input`` is a string or a list of items. Items map into the internal chat form, in order:

- ``message`` (roles developer/system/user/assistant; parts input_text/output_text/refusal/input_image)
  becomes a message; ``instructions``, when present, becomes a system message in front of them all.
- Consecutive output items of one model turn (``reasoning``, an assistant ``message``, ``function_call``,
  ``custom_tool_call``) fold into ONE assistant message (reasoning, content, tool calls), which is how the
  engine produced them, so that the next prompt extends the previous prompt + sampled tokens by prefix.
- ``function_call_output`` / ``custom_tool_call_output`` become tool messages.
- ``reasoning`` items carry the reasoning text back in ``encrypted_content``: this proxy makes that value
  itself (the reasoning codec, :mod:`proxy.apis.reasoning`: an opaque, checksummed, compressed encoding of the
  text; nothing is stored) and decodes it to exactly the text the engine sampled. A value it did not
  make (a conversation begun on another server) cannot be read: the item's ``reasoning_text`` content is
  used if present, else the reasoning is dropped and logged. A damaged value of ours, or one over the
  codec's size limits, is a 400 naming ``input.N.encrypted_content``.
- Every item is an object; its ``type`` (and a message's ``role``, a call's ``call_id``, ``name`` and
  ``namespace``) must be strings, checked by small per-kind pydantic models: a 400 names the field.
- Items of hosted tools (``web_search_call``, ``tool_search_call``/``_output``, ``file_search_call``, …)
  and server-side ``compaction`` items are dropped and logged: the engine never produced them.

Tools:

- ``function`` tools pass through.
- ``custom`` (freeform) tools, such as Codex's ``apply_patch`` with its Lark grammar, are offered to the
  engine as a function taking one string argument ``{"input": string}`` (``ToolDefinition.kind="custom"``,
  the grammar kept in the event). The model's call comes back as a ``custom_tool_call`` whose ``input``
  is that string; a ``custom_tool_call`` in the history normalizes back to the same arguments JSON.
- ``namespace`` tools are flattened: each nested function (``type: "function"`` and a string ``name``,
  both required) is offered as ``{namespace}__{name}`` and the model's call is mapped back to ``name`` +
  ``namespace``.
- Hosted tools the engine cannot run (``web_search``, ``tool_search``, ``file_search``, ``code_interpreter``,
  ``image_generation``, ``computer_use``, ``mcp``, ``local_shell``, …) are DROPPED from what the engine
  sees (logged at INFO). The decision: a harness like Codex always offers ``web_search``; refusing the
  request would make it unusable, and offering a tool nobody can execute would let the model call it.
  ``tool_choice`` naming a hosted tool is refused (400): that request cannot be honoured.

Also accepted: ``max_output_tokens``, ``temperature``, ``top_p``, ``reasoning.effort`` (low/medium/high
passed on; ``minimal`` as low, ``xhigh`` as high, ``none`` omitted), ``tool_choice``,
``parallel_tool_calls``, ``store``, ``include``, ``stream``, ``text`` (format and verbosity are not
enforced), ``prompt_cache_key``, ``metadata``, ``client_metadata``. Not supported (400):
``previous_response_id`` and ``conversation``, since nothing is stored: the harness must send the
whole conversation (Codex does, with ``store: false``).

Replies: a whole ``response`` object, or the event sequence a real server sends, each frame with an
``event:`` line and a ``sequence_number``: response.created, response.in_progress, then per output item
output_item.added, its part/delta/done events and output_item.done, then response.completed (or
response.incomplete when the token limit cut it off) with usage. Reasoning the engine produced is an item
with the raw text as ``reasoning_text`` content (``response.reasoning_text.delta``/``.done``, as servers of
open-weight models send it), an empty ``summary`` (no summary is made, so none is claimed), and
``encrypted_content`` when ``include`` asks for it. When ``include`` has ``message.output_text.logprobs``,
the output text carries the engine's entry for each sampled token (``top_logprobs`` alternatives, 0-20,
asked of the engine), as vLLM's own Responses endpoint does: whole, every token of the reply; streamed,
each ``output_text.delta`` its own tokens. Tool-call items are closed only in the
closing part (:meth:`ResponsesRenderer.stream_finish`), which is sent after the call is recorded: a
harness that runs a tool on ``output_item.done`` never runs one whose call went unrecorded. Freeform
inputs are known only once the call's arguments are complete, so their delta/done come then too.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.turns import EngineDelta, EngineTurn, ToolCallDelta
from proxy.errors import BadRequest, ProxyError
from proxy.apis.base import openai_error_body, ParsedCall, Route, bad_request, validate_body
from proxy.apis.reasoning import ReasoningBudget, decode_reasoning, encode_reasoning
from proxy.apis.token_entries import checked_top_logprobs, openai_entries, stream_entries
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

_KNOWN_IGNORED = {"store", "include", "parallel_tool_calls", "prompt_cache_key", "metadata", "client_metadata",
                  "text", "user", "service_tier", "truncation", "safety_identifier", "background",
                  "stream_options", "max_tool_calls", "prompt_cache_retention"}
# Items that record what a hosted tool or the server did: the engine never produced them.
_DROPPED_ITEMS = {"web_search_call", "tool_search_call", "tool_search_output", "file_search_call",
                  "image_generation_call", "code_interpreter_call", "computer_call", "computer_call_output",
                  "mcp_list_tools", "mcp_call", "mcp_approval_request", "mcp_approval_response", "compaction",
                  "item_reference", "additional_tools"}
_HOSTED_TOOLS = {"web_search", "web_search_preview", "tool_search", "file_search", "code_interpreter",
                 "image_generation", "computer_use", "computer_use_preview", "mcp", "local_shell"}
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "minimal": "low", "xhigh": "high"}
NAMESPACE_SEPARATOR = "__"
CUSTOM_INPUT = "input"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


WireT = TypeVar("WireT", bound=_Wire)


class WireTool(_Wire):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    format: dict[str, Any] | None = None  # custom tools: {"type": "grammar", "syntax": ..., "definition": ...}
    tools: list[dict[str, Any]] | None = None  # namespace tools: nested function tools (NamespacedFunction)


class NamespacedFunction(_Wire):
    """A function tool inside a ``namespace`` tool."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolChoiceObject(_Wire):
    """``tool_choice`` as an object: a named function or custom tool, allowed_tools, or a hosted tool."""

    type: str
    name: str | None = None
    namespace: str | None = None
    mode: str | None = None


# -- input items, one small model per kind: what the normalizer reads of them, with types checked --------

class ItemHead(_Wire):
    """Any input item, before its kind is known (a message may leave ``type`` out)."""

    type: str | None = None


class MessageItem(_Wire):
    role: Literal["user", "system", "developer", "assistant"]
    content: Any = None


class ReasoningItem(_Wire):
    id: str | None = None
    encrypted_content: str | None = None
    content: Any = None


class FunctionCallItem(_Wire):
    call_id: str
    name: str
    arguments: Any = ""
    namespace: str | None = None


class CustomToolCallItem(_Wire):
    call_id: str
    name: str
    input: str


class ToolOutputItem(_Wire):
    call_id: str
    output: Any


class PartHead(_Wire):
    """Any content part, before its kind is known."""

    type: str


class InputImagePart(_Wire):
    image_url: str | None = None
    file_id: str | None = None


class WireReasoning(_Wire):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Wire):
    """POST /v1/responses, as far as we read it."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[WireTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    reasoning: WireReasoning | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None


def parse_request(document: Any) -> ResponsesRequest:
    """Validate a decoded JSON body; BadRequest names the first offending field."""
    request = validate_body(ResponsesRequest, document, _KNOWN_IGNORED)
    if request.previous_response_id is not None or request.conversation is not None:
        param = "previous_response_id" if request.previous_response_id is not None else "conversation"
        raise BadRequest(f"{param} is not supported: this server stores nothing, send the whole conversation "
                         "in input (store: false)", param=param)
    if isinstance(request.input, list) and not request.input:
        raise BadRequest("input must not be empty", param="input")
    return request


def _validated(model: type[WireT], value: Any, where: str) -> WireT:
    """``value`` (one item, part or object of the request) as ``model``; a 400 names the field at ``where``."""
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise bad_request(exc, where) from exc


# -- tools --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolTarget:
    """How a tool name the engine sees maps back to the Responses API."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


@dataclass
class ToolMap:
    """Tool definitions as the engine sees them, and the way back from engine names."""

    definitions: list[ToolDefinition] = field(default_factory=list)
    targets: dict[str, ToolTarget] = field(default_factory=dict)

    def target(self, engine_name: str) -> ToolTarget:
        return self.targets.get(engine_name) or ToolTarget("function", engine_name)

    def add(self, definition: ToolDefinition, target: ToolTarget, where: str) -> None:
        if definition.name in self.targets:
            raise BadRequest(f"duplicate tool name {definition.name!r}", param=where)
        self.definitions.append(definition)
        self.targets[definition.name] = target


def _custom_parameters(grammar: dict[str, Any] | None) -> dict[str, Any]:
    """One string argument; the grammar, if any, is shown in its description (the engine does not enforce it)."""
    text = "The tool's whole input, as free text in the format the tool's description asks for."
    if grammar and isinstance(grammar.get("definition"), str):
        text += f" It must match this {grammar.get('syntax', '')} grammar:\n{grammar['definition']}"
    return {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": text}},
            "required": [CUSTOM_INPUT]}


def _function_tool(tool: WireTool | NamespacedFunction, where: str) -> tuple[str, str | None, dict[str, Any] | None]:
    if not tool.name:
        raise BadRequest("a function tool needs a name", param=f"{where}.name")
    return tool.name, tool.description, tool.parameters


def build_tools(tools: list[WireTool] | None) -> ToolMap:
    """The engine's tool list: functions, custom tools as one-string functions, namespaces flattened."""
    out = ToolMap()
    dropped: list[str] = []
    for i, tool in enumerate(tools or ()):
        where = f"tools.{i}"
        if tool.type == "function":
            name, description, parameters = _function_tool(tool, where)
            out.add(ToolDefinition(name=name, description=description, parameters=parameters),
                    ToolTarget("function", name), where)
        elif tool.type == "custom":
            if not tool.name:
                raise BadRequest("a custom tool needs a name", param=f"{where}.name")
            out.add(ToolDefinition(name=tool.name, description=tool.description, kind="custom", grammar=tool.format,
                                   parameters=_custom_parameters(tool.format)), ToolTarget("custom", tool.name), where)
        elif tool.type == "namespace":
            if not tool.name:
                raise BadRequest("a namespace tool needs a name", param=f"{where}.name")
            for j, raw in enumerate(tool.tools or ()):
                nested = _validated(NamespacedFunction, raw, f"{where}.tools.{j}")
                name, description, parameters = _function_tool(nested, f"{where}.tools.{j}")
                flat = f"{tool.name}{NAMESPACE_SEPARATOR}{name}"
                out.add(ToolDefinition(name=flat, description=description, parameters=parameters),
                        ToolTarget("function", name, tool.name), f"{where}.tools.{j}")
        elif tool.type in _HOSTED_TOOLS:
            dropped.append(tool.type)
        else:
            raise BadRequest(f"unsupported tool type {tool.type!r}", param=f"{where}.type")
    if dropped:
        logger.info("hosted tools dropped (the engine cannot run them): %s", dropped)
    return out


def _engine_name(name: str, namespace: str | None) -> str:
    if namespace:
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    return name


def _tool_choice(choice: str | dict[str, Any] | None, tools: ToolMap) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise BadRequest(f"unsupported tool_choice {choice!r}", param="tool_choice")
        return choice
    named = _validated(ToolChoiceObject, choice, "tool_choice")
    kind = named.type
    if kind in ("function", "custom"):
        if named.name is None:
            raise BadRequest("tool_choice needs a name", param="tool_choice.name")
        engine_name = _engine_name(named.name, named.namespace)
        if engine_name not in tools.targets:
            raise BadRequest(f"tool_choice names a tool that is not offered: {named.name!r}",
                             param="tool_choice.name")
        return {"type": "function", "function": {"name": engine_name}}
    if kind == "allowed_tools":
        logger.debug("tool_choice allowed_tools: the tool list is not narrowed, mode kept")
        return "required" if named.mode == "required" else "auto"
    raise BadRequest(f"tool_choice {kind!r} names a tool the engine cannot run", param="tool_choice")


# -- input items ----------------------------------------------------------------------------------------


def _text_of_part(part: Any, where: str) -> ContentPart:
    kind = _validated(PartHead, part, where).type
    if kind in ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"):
        text = part.get("text") if kind != "refusal" else part.get("refusal")
        if not isinstance(text, str):
            raise BadRequest(f"a {kind} part needs a string", param=where)
        return ContentPart(type="text", text=text)
    if kind == "input_image":
        image = _validated(InputImagePart, part, where)
        return ContentPart(type="image", data=image.image_url or image.file_id)
    raise BadRequest(f"unsupported content part type {kind!r}", param=f"{where}.type")


def _parts(content: Any, where: str) -> list[ContentPart]:
    if not isinstance(content, list):
        raise BadRequest("content must be a string or a list of parts", param=where)
    return [_text_of_part(p, f"{where}.{i}") for i, p in enumerate(content)]


def _joined_text(parts: list[ContentPart], where: str) -> str:
    if any(p.type != "text" for p in parts):
        raise BadRequest("assistant content can hold text only", param=where)
    return "".join(p.text or "" for p in parts)


def _output_content(output: Any, where: str) -> str | list[ContentPart]:
    """A tool output: a string, or a list of content items (text, images)."""
    if isinstance(output, str):
        return output
    return _parts(output, where)


def _reasoning_text(item: ReasoningItem, where: str, budget: ReasoningBudget) -> str | None:
    encrypted = item.encrypted_content
    if encrypted:
        text = decode_reasoning(encrypted, param=f"{where}.encrypted_content", budget=budget)
        if text is not None:
            return text
    content = item.content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "reasoning_text"]
        strings = [t for t in texts if isinstance(t, str)]
        if texts and len(strings) == len(texts):
            return "".join(strings)
    if encrypted:
        logger.info("reasoning item %s: encrypted_content not made by this proxy, reasoning dropped", item.id)
    return None


def custom_arguments(text: str) -> str:
    """The function arguments the engine sees for a freeform tool input."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The freeform input from the arguments the model sampled for a custom tool: its ``input`` string, or
    the one string value it gave, else the arguments text itself."""
    try:
        value = orjson.loads(arguments)  # orjson: deep nesting is a decode error, never a RecursionError
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if isinstance(value.get(CUSTOM_INPUT), str):
            return value[CUSTOM_INPUT]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    return arguments


class _Builder:
    """Folds input items into chat messages, one assistant message per model turn."""

    def __init__(self, tools: ToolMap) -> None:
        self.tools = tools
        self.messages: list[dict[str, Any]] = []
        self.budget = ReasoningBudget()  # one per request: its encrypted_content values inflate within the limit

    def _open_assistant(self, *, reasoning: bool = False, content: bool = False) -> dict[str, Any]:
        last = self.messages[-1] if self.messages and self.messages[-1]["role"] == "assistant" else None
        if last is not None:
            blocked = (reasoning and (last["reasoning"] is not None or last["content"] is not None
                                      or last["tool_calls"])) or (content and (last["content"] is not None
                                                                              or last["tool_calls"]))
            if not blocked:
                return last
        message: dict[str, Any] = {"role": "assistant", "content": None, "reasoning": None, "tool_calls": []}
        self.messages.append(message)
        return message

    def add(self, item: Any, where: str) -> None:
        head = _validated(ItemHead, item, where)
        kind = head.type or ("message" if "role" in item else None)
        if kind == "message":
            self._message(_validated(MessageItem, item, where), where)
        elif kind == "reasoning":
            text = _reasoning_text(_validated(ReasoningItem, item, where), where, self.budget)
            if text is not None:
                self._open_assistant(reasoning=True)["reasoning"] = text
        elif kind == "function_call":
            call = _validated(FunctionCallItem, item, where)
            arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments,
                                                                                           ensure_ascii=False)
            flat = _engine_name(call.name, call.namespace)
            self._open_assistant()["tool_calls"].append(ToolCall(id=call.call_id, name=flat, arguments=arguments))
        elif kind == "custom_tool_call":
            custom = _validated(CustomToolCallItem, item, where)
            self._open_assistant()["tool_calls"].append(ToolCall(id=custom.call_id, name=custom.name, kind="custom",
                                                                 arguments=custom_arguments(custom.input)))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = _validated(ToolOutputItem, item, where)
            self.messages.append({"role": "tool", "content": _output_content(output.output, f"{where}.output"),
                                  "tool_call_id": output.call_id})
        elif kind in _DROPPED_ITEMS:
            logger.info("input item of type %s dropped (hosted tool or server state)", kind)
        else:
            raise BadRequest(f"unsupported input item type {kind!r}", param=f"{where}.type")

    def _message(self, item: MessageItem, where: str) -> None:
        content = item.content
        if item.role == "assistant":
            text = content if isinstance(content, str) else _joined_text(_parts(content, f"{where}.content"),
                                                                        f"{where}.content")
            self._open_assistant(content=True)["content"] = text
            return
        value = content if isinstance(content, str) else _parts(content, f"{where}.content")
        self.messages.append({"role": item.role, "content": value})

    def result(self) -> list[ChatMessage]:
        return [ChatMessage(**m) for m in self.messages]


OUTPUT_LOGPROBS = "message.output_text.logprobs"


def _engine_extras(request: ResponsesRequest) -> dict[str, Any]:
    """The alternatives per token (``top_logprobs``) of a harness whose ``include`` asks for logprobs."""
    top = checked_top_logprobs(request.top_logprobs, "top_logprobs")
    return {"top_logprobs": top} if top and OUTPUT_LOGPROBS in (request.include or ()) else {}


def normalize(request: ResponsesRequest) -> tuple[NormalizedRequest, ToolMap]:
    """The internal request form of a Responses request, and the tool map its replies need."""
    tools = build_tools(request.tools)
    builder = _Builder(tools)
    if request.instructions:
        builder.messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        builder.messages.append({"role": "user", "content": request.input})
    else:
        for i, item in enumerate(request.input):
            builder.add(item, f"input.{i}")
    effort = request.reasoning.effort if request.reasoning else None
    if effort is not None and effort not in _EFFORTS and effort != "none":
        raise BadRequest(f"unsupported reasoning.effort {effort!r}", param="reasoning.effort")
    normalized = NormalizedRequest(
        messages=builder.result(),
        tools=tools.definitions,
        tool_choice=_tool_choice(request.tool_choice, tools) if tools.definitions else None,
        sampling=SamplingParams(temperature=request.temperature, top_p=request.top_p,
                                max_tokens=request.max_output_tokens, extra=_engine_extras(request)),
        stream=request.stream,
        reasoning_effort=_EFFORTS.get(effort) if effort else None,
    )
    return normalized, tools


# -- replies --------------------------------------------------------------------------------------------


def _usage(turn: EngineTurn) -> dict[str, Any]:
    u = turn.usage
    # cache_write_tokens: OpenAI's newer models report it, and the SDKs now type it as always there.
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens or 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


# What a failed response's ``error.code`` may be (the SDKs check it against OpenAI's list); the ``error``
# event before it keeps the proxy's own code. context_length_exceeded is not on the list but is what
# Codex looks for to compact its history, so it is kept.
_FAILED_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt", "context_length_exceeded"})


def _failed_code(error: ProxyError, code: str | None) -> str:
    if code in _FAILED_CODES:
        return code
    return "server_error" if error.status_code >= 500 else "invalid_prompt"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _OpenItem:
    """An output item being streamed."""

    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)
    closed: bool = False
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # an output_text's entries, when asked for


class ResponsesRenderer:
    """Renders one call's reply, whole or streamed, in the Responses shape."""

    def __init__(self, request: ResponsesRequest, tools: ToolMap) -> None:
        self.request = request
        self.tools = tools
        self.model = request.model or "rollwire"
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.include_encrypted = "reasoning.encrypted_content" in (request.include or ())
        self.logprobs = OUTPUT_LOGPROBS in (request.include or ())
        self._sequence = 0
        self._started = False
        self._items: list[_OpenItem] = []
        self._open: _OpenItem | None = None  # the reasoning or message item receiving text
        self._calls: dict[int, _OpenItem] = {}  # engine tool-call index -> its item

    # -- the response object
    def _response(self, status: str, output: list[dict[str, Any]], turn: EngineTurn | None) -> dict[str, Any]:
        request = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": bool((request.model_extra or {}).get("parallel_tool_calls", True)),
                "previous_response_id": None, "reasoning": {"effort": request.reasoning.effort if request.reasoning
                                                            else None, "summary": None},
                "store": bool((request.model_extra or {}).get("store", False)),
                "temperature": request.temperature, "text": (request.model_extra or {}).get("text"),
                "tool_choice": request.tool_choice or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in request.tools or ()], "top_p": request.top_p,
                "top_logprobs": request.top_logprobs, "truncation": "disabled", "usage": _usage(turn) if turn is not None else None,
                "metadata": {}}

    def _reasoning_item(self, text: str, item_id: str | None = None) -> dict[str, Any]:
        item: dict[str, Any] = {"id": item_id or _new_id("rs"), "type": "reasoning", "summary": [],
                                "content": [{"type": "reasoning_text", "text": text}]}
        if self.include_encrypted:
            item["encrypted_content"] = encode_reasoning(text)
        return item

    def _call_item(self, call: ToolCall, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
        target = self.tools.target(call.name)
        if target.kind == "custom":
            return {"id": item_id or _new_id("ctc"), "type": "custom_tool_call", "status": status,
                    "call_id": call.id, "name": target.name, "input": custom_input(call.arguments)}
        item = {"id": item_id or _new_id("fc"), "type": "function_call", "status": status, "call_id": call.id,
                "name": target.name, "arguments": call.arguments}
        if target.namespace:
            item["namespace"] = target.namespace
        return item

    def _output(self, turn: EngineTurn) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = []
        if turn.reasoning:
            output.append(self._reasoning_item(turn.reasoning))
        cut = turn.finish_reason == "length"
        if turn.content:
            status = "incomplete" if cut and not turn.tool_calls else "completed"
            output.append({"id": _new_id("msg"), "type": "message", "status": status, "role": "assistant",
                           "content": [{"type": "output_text", "text": turn.content, "annotations": [],
                                        "logprobs": self._entries(turn.logprobs, turn.logprob_entries)}]})
        status = "incomplete" if cut else "completed"
        output.extend(self._call_item(c, status=status) for c in turn.tool_calls)
        return output

    def _entries(self, values: list[float | None], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An output text's logprob entries, when the request's ``include`` asked for them: every sampled
        token of the reply's (as vLLM's own Responses endpoint gives them: the text's, and any reasoning's
        and tool call's before or after it)."""
        return openai_entries(values, entries, bytes_always=True) if self.logprobs and values else []

    @staticmethod
    def _status(turn: EngineTurn) -> str:
        return "incomplete" if turn.finish_reason == "length" else "completed"

    def response(self, turn: EngineTurn) -> dict[str, Any]:
        return self._response(self._status(turn), self._output(turn), turn)

    # -- the stream
    def _event(self, kind: str, **fields: Any) -> bytes:
        document = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(document) + b"\n\n"

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        opening = self._response("in_progress", [], None)
        return [self._event("response.created", response=opening),
                self._event("response.in_progress", response=opening)]

    def _add_item(self, item: dict[str, Any]) -> tuple[_OpenItem, bytes]:
        entry = _OpenItem(len(self._items), item)
        self._items.append(entry)
        return entry, self._event("response.output_item.added", output_index=entry.index, item=item)

    def _close_text_item(self, status: str = "completed") -> list[bytes]:
        entry, self._open = self._open, None
        if entry is None:
            return []
        entry.closed = True
        text = "".join(entry.text)
        item_id, index = entry.item["id"], entry.index
        part: dict[str, Any]
        if entry.item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            entry.item = self._reasoning_item(text, item_id)
            return [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                content_index=0, text=text),
                    self._event("response.content_part.done", item_id=item_id, output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=entry.item)]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": entry.logprobs}
        entry.item = {**entry.item, "status": status, "content": [part]}
        return [self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=text, logprobs=stream_entries(entry.logprobs)),
                self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=entry.item)]

    def _text(self, kind: Literal["reasoning", "message"], text: str,
              logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        chunks: list[bytes] = []
        if self._open is None or self._open.item["type"] != kind:
            chunks += self._close_text_item()
            item: dict[str, Any]
            part: dict[str, Any]
            if kind == "reasoning":
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open, added = self._add_item(item)
            chunks += [added, self._event("response.content_part.added", item_id=item["id"],
                                          output_index=self._open.index, content_index=0, part=part)]
        entry = self._open
        entry.text.append(text)
        entry.logprobs += logprobs or ()
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": stream_entries(logprobs or [])}
        chunks.append(self._event(kind_event, item_id=entry.item["id"], output_index=entry.index, content_index=0,
                                  delta=text, **extra))
        return chunks

    def _call_delta(self, part: ToolCallDelta) -> list[bytes]:
        chunks: list[bytes] = []
        entry = self._calls.get(part.index)
        if entry is None:
            chunks += self._close_text_item()
            call = ToolCall(id=part.id or _new_id("call"), name=part.name or "", arguments="")
            item = self._call_item(call, status="in_progress")
            entry, added = self._add_item(item)
            self._calls[part.index] = entry
            chunks.append(added)
        entry.text.append(part.arguments)
        if part.arguments and entry.item["type"] == "function_call":
            chunks.append(self._event("response.function_call_arguments.delta", item_id=entry.item["id"],
                                      output_index=entry.index, delta=part.arguments))
        return chunks

    def stream_delta(self, delta: EngineDelta) -> list[bytes]:
        """Events for one engine delta; tool-call items stay open until :meth:`stream_finish`."""
        chunks = self._start()
        if delta.reasoning:
            chunks += self._text("reasoning", delta.reasoning)
        if delta.content:  # the delta's tokens (its reasoning's too) go with its text, as vLLM's stream has it
            chunks += self._text("message", delta.content, self._entries(delta.logprobs, delta.logprob_entries))
        for part in delta.tool_calls:
            chunks += self._call_delta(part)
        return chunks

    def _close_call(self, entry: _OpenItem, status: str) -> list[bytes]:
        entry.closed = True
        arguments = "".join(entry.text)
        item, index = entry.item, entry.index
        if item["type"] == "custom_tool_call":
            text = custom_input(arguments)
            entry.item = {**item, "status": status, "input": text}
            chunks = [self._event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                                  delta=text),
                      self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                  input=text)]
        else:
            entry.item = {**item, "status": status, "arguments": arguments}
            chunks = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=arguments)]
        return chunks + [self._event("response.output_item.done", output_index=index, item=entry.item)]

    def stream_finish(self, turn: EngineTurn) -> list[bytes]:
        """The closing events: open items done, then response.completed (or .incomplete) with usage."""
        status = self._status(turn)
        chunks = self._start() + self._close_text_item("completed" if status == "completed" else "incomplete")
        for entry in self._items:
            if not entry.closed:  # a call cut off by the token limit is marked incomplete, as OpenAI does
                chunks += self._close_call(entry, "completed" if status == "completed" else "incomplete")
        final = self._response(status, [e.item for e in self._items], turn)
        return chunks + [self._event(f"response.{status}", response=final)]

    def stream_whole(self, turn: EngineTurn) -> list[bytes]:
        """A synthetic stream for a turn the engine returned whole."""
        chunks = self.stream_delta(EngineDelta(reasoning=turn.reasoning, content=turn.content, logprobs=turn.logprobs,
                                               logprob_entries=turn.logprob_entries))
        calls = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(turn.tool_calls)]
        if calls:
            chunks += self.stream_delta(EngineDelta(tool_calls=calls))
        return chunks + self.stream_finish(turn)

    def stream_error(self, error: ProxyError) -> list[bytes]:
        """An ``error`` event, then ``response.failed``: the harness sees the call fail and may retry."""
        body = openai_error_body(error)["error"]
        failed = self._response("failed", [e.item for e in self._items if e.closed], None)
        failed["error"] = {"code": _failed_code(error, body["code"]), "message": body["message"]}
        return self._start() + [self._event("error", code=body["code"], message=body["message"], param=body["param"]),
                                self._event("response.failed", response=failed)]


class ResponsesApi:
    """``POST /v1/responses``."""

    name: ProviderApi = "openai.responses"
    stream_media_type = "text/event-stream"

    def parse(self, document: Any, route: Route) -> ParsedCall:
        wire = parse_request(document)
        request, tools = normalize(wire)
        return ParsedCall(requested_model=wire.model, request=request, renderer=ResponsesRenderer(wire, tools))

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        return openai_error_body(error)
