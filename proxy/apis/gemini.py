"""Gemini API (``generateContent`` / ``streamGenerateContent``): parsing, normalization, replies, SSE.

Owns the Gemini wire format (``v1beta``) as harnesses built on Google's SDKs send it (Pi's
``google-generative-ai`` API, ``@google/genai``). The model and streaming come from the URL
(:class:`~proxy.apis.base.Route`), not the body.

Choices where Gemini and the internal form differ:

- **Tool-call ids.** Gemini's ``functionCall`` / ``functionResponse`` usually carry no id. A call without
  one gets a derived id, ``gc_<digest of name and canonical args>_<n>`` (n: how many identical calls came
  before it in the history), so the same history normalizes to the same ids every turn, wherever the
  harness puts it. Replies carry that same id in ``functionCall.id``. A ``functionResponse`` pairs with a
  still-unanswered call of the model turn before it: by id when the id matches one, else the first one
  with the same name.
- **Thought signatures.** The engine's reasoning is handed out as ``thoughtSignature`` (the reasoning
  codec's value, :mod:`proxy.apis.reasoning`: plain standard base64, as Google's SDKs require) on the first
  non-thought part after the reasoning and on the first ``functionCall``; when a model turn comes back
  with it, the reasoning is recovered exactly, so the prompt is rebuilt as the engine produced it.
  Thought parts (``thought: true``) are sent only when ``thinkingConfig.includeThoughts`` asks for them,
  as Gemini does; echoed thought text is the fallback when no signature of ours is there. Foreign
  signatures are ignored; a damaged one of ours, or one over the codec's size limits, is a 400.
- **Schemas.** Gemini's schemas (``generationConfig.responseSchema`` and ``responseJsonSchema``, function
  declarations' ``parameters`` and ``parametersJsonSchema``) may use OpenAPI's upper-case type names
  (``OBJECT``, ``STRING``, …; Gemini CLI's router does, even in ``responseJsonSchema``); vLLM's
  structured outputs want JSON Schema's, so all four go through :func:`json_schema` on their way in.
- **Tool results.** ``functionResponse.response`` becomes a ``tool`` message: the string under
  ``output`` / ``result`` / ``content`` when that is the only key, the string under ``error`` (marked
  ``is_error``), otherwise the object as JSON.
- **Hosted tools** (``googleSearch``, ``codeExecution``, ``urlContext``, …) cannot run on the engine: they
  are dropped and logged, like ``safetySettings`` and ``cachedContent``.
- **Streaming.** ``streamGenerateContent?alt=sse`` answers ``data: {GenerateContentResponse}`` chunks.
  Without ``alt=sse`` Gemini streams one JSON array of the same objects; we send that framing
  (``[{…},\\r\\n{…}]``), under the proxy's ``text/event-stream`` content type. Text and thoughts stream
  as the engine produces them; ``functionCall`` parts are sent whole (Gemini never streams partial
  arguments) in the closing chunk, with ``finishReason`` and ``usageMetadata``, after the call is recorded.
  A sampled call whose arguments are not a JSON object within the depth bound
  (:func:`proxy.apis.anthropic_messages.arguments_object`) is left out and the candidate's ``finishReason``
  is ``MALFORMED_FUNCTION_CALL``, Gemini's own answer to such a call.
- **Logprobs.** ``generationConfig.responseLogprobs`` gives each candidate ``logprobsResult``: the engine's
  entry for each sampled token (``chosenCandidates``, with ``tokenId`` where the engine gave the id) and
  the ``generationConfig.logprobs`` alternatives it was asked for (``topCandidates``), and
  ``avgLogprobs`` with the finish reason. Streamed, a chunk carries its own tokens; tokens of a
  ``functionCall`` (sent whole at the end) come with the closing chunk.
- **A failure mid-stream** (the engine broke off, a limit) ends an ``alt=sse`` stream with Google's bare
  error object (``{"error": {"code", "message", "status"}}`` and a newline, no ``data:``), which Google's
  SDKs raise as an API error with that code (``@google/genai`` for JS looks for it in each read of the
  body, and only there: a ``data: {"error": …}`` event became an empty chunk, and Gemini CLI retried the
  stream and then printed the failed attempts' partial text as its answer, exit status 0). In the JSON
  array framing the error object is the array's last element.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from typing import Any, Literal

import orjson
from pydantic import AliasChoices, AliasGenerator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_snake

from proxy.turns import EngineDelta, EngineTurn
from proxy.errors import BadRequest, ProxyError
from proxy.apis.base import arguments_object, ParsedCall, Route, validate_body
from proxy.apis.reasoning import ReasoningBudget, decode_reasoning, encode_reasoning
from proxy.apis.token_entries import average, checked_top_logprobs, gemini_logprobs, usable
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

_KNOWN_IGNORED = {"safetySettings", "safety_settings", "cachedContent", "cached_content", "labels", "model"}


def _either_spelling(name: str) -> AliasChoices:
    """A field's two JSON names: Gemini's REST API takes proto field names in lowerCamelCase and in
    snake_case alike, and clients send both (google-genai writes ``parameters_json_schema``,
    ``include_thoughts``, ``mime_type``). Errors name the camelCase one."""
    return AliasChoices(name, to_snake(name))


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow", alias_generator=AliasGenerator(validation_alias=_either_spelling))


class FunctionCall(_Wire):
    name: str = Field(min_length=1)
    args: dict[str, Any] | None = None
    id: str | None = None


class FunctionResponse(_Wire):
    name: str = Field(min_length=1)
    response: dict[str, Any] | None = None
    id: str | None = None


class Blob(_Wire):
    mimeType: str
    data: str


class FileData(_Wire):
    mimeType: str | None = None
    fileUri: str


class Part(_Wire):
    text: str | None = None
    thought: bool | None = None
    thoughtSignature: str | None = None
    functionCall: FunctionCall | None = None
    functionResponse: FunctionResponse | None = None
    inlineData: Blob | None = None
    fileData: FileData | None = None


class Content(_Wire):
    # Gemini treats a missing role as "user"; "function" is the v1beta-era role for function responses.
    role: Literal["user", "model", "function"] | None = None
    parts: list[Part] = Field(min_length=1)


class FunctionDeclaration(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parametersJsonSchema: dict[str, Any] | None = None


class Tool(_Wire):
    functionDeclarations: list[FunctionDeclaration] | None = None


class FunctionCallingConfig(_Wire):
    mode: Literal["MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"] | None = None
    allowedFunctionNames: list[str] | None = None


class ToolConfig(_Wire):
    functionCallingConfig: FunctionCallingConfig | None = None


class ThinkingConfig(_Wire):
    includeThoughts: bool | None = None
    thinkingBudget: int | None = None
    thinkingLevel: str | None = None


class GenerationConfig(_Wire):
    temperature: float | None = Field(default=None, ge=0)
    topP: float | None = None
    topK: int | None = None
    maxOutputTokens: int | None = Field(default=None, ge=1)
    stopSequences: list[str] | None = None
    seed: int | None = None
    candidateCount: int | None = None
    presencePenalty: float | None = None
    frequencyPenalty: float | None = None
    responseMimeType: str | None = None
    responseSchema: dict[str, Any] | None = None
    responseJsonSchema: dict[str, Any] | None = None
    thinkingConfig: ThinkingConfig | None = None
    responseLogprobs: bool | None = None
    logprobs: int | None = None


class GenerateContentRequest(_Wire):
    """The body of ``generateContent`` / ``streamGenerateContent``, as far as we read it."""

    contents: list[Content] = Field(min_length=1)
    systemInstruction: Content | None = None
    tools: list[Tool] | None = None
    toolConfig: ToolConfig | None = None
    generationConfig: GenerationConfig | None = None


def parse_request(document: Any) -> GenerateContentRequest:
    """Validate a decoded JSON body; BadRequest names the first offending field."""
    request = validate_body(GenerateContentRequest, document, _KNOWN_IGNORED)
    config = request.generationConfig
    if config is not None and config.candidateCount not in (None, 1):
        raise BadRequest("only candidateCount 1 is supported: each sample is its own session",
                         param="generationConfig.candidateCount")
    ignored = set(request.model_extra or ()) & {"safetySettings", "safety_settings", "cachedContent", "cached_content"}
    if ignored:
        logger.info("gemini request: %s accepted and ignored", sorted(ignored))
    return request


# -- call ids -----------------------------------------------------------------------------------------

def _call_key(name: str, args: dict[str, Any]) -> str:
    canonical = json.dumps([name, args], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


class _CallIds:
    """Derives ids for calls that have none: digest of the call plus its occurrence in the history."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def next(self, name: str, args: dict[str, Any]) -> str:
        key = _call_key(name, args)
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        return f"gc_{key}_{n}"


# -- normalization -------------------------------------------------------------------------------------

_RESULT_KEYS = ("output", "result", "content")


def _tool_result(response: dict[str, Any] | None) -> tuple[str, bool]:
    response = response or {}
    if len(response) == 1:
        [(key, value)] = response.items()
        if key in _RESULT_KEYS and isinstance(value, str):
            return value, False
        if key == "error":
            return (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)), True
    return json.dumps(response, ensure_ascii=False), False


def _user_part(part: Part, where: str) -> ContentPart:
    if part.text is not None:
        return ContentPart(type="text", text=part.text)
    blob = part.inlineData or part.fileData
    if blob is not None and (blob.mimeType or "").startswith("image/"):
        data = part.inlineData.data if part.inlineData else part.fileData.fileUri  # type: ignore[union-attr]
        return ContentPart(type="image", media_type=blob.mimeType, data=data)
    kinds = sorted(k for k, v in part.model_dump(exclude_none=True).items() if k != "thoughtSignature")
    raise BadRequest(f"unsupported part {kinds or 'with no data'} in a user turn: send text, images, "
                     "or functionResponse", param=where)


def _flush_user(parts: list[ContentPart], messages: list[ChatMessage]) -> None:
    if parts:
        messages.append(ChatMessage(role="user", content=list(parts)))
        parts.clear()


def _user_messages(content: Content, i: int, pending: list[ToolCall], orphans: _CallIds) -> list[ChatMessage]:
    """A user turn: tool messages for its functionResponses, user messages for the rest, in order."""
    messages: list[ChatMessage] = []
    texts: list[ContentPart] = []
    for j, part in enumerate(content.parts):
        where = f"contents.{i}.parts.{j}"
        if part.functionResponse is None:
            if part.text is None and part.inlineData is None and part.fileData is None and part.thoughtSignature:
                continue  # a bare signature carries nothing for a user turn
            texts.append(_user_part(part, where))
            continue
        _flush_user(texts, messages)
        response = part.functionResponse
        call = _pair(response, pending)
        call_id = call.id if call is not None else response.id or orphans.next(response.name, response.response or {})
        if call is None:
            logger.info("gemini functionResponse %s at %s answers no pending functionCall", response.name, where)
        text, is_error = _tool_result(response.response)
        messages.append(ChatMessage(role="tool", content=text, tool_call_id=call_id, name=response.name,
                                    is_error=is_error or None))
    _flush_user(texts, messages)
    return messages


def _pair(response: FunctionResponse, pending: list[ToolCall]) -> ToolCall | None:
    """The pending call a functionResponse answers (removed from ``pending``): by id, else by name."""
    match = next((c for c in pending if response.id is not None and c.id == response.id), None)
    match = match or next((c for c in pending if c.name == response.name), None)
    if match is not None:
        pending.remove(match)
    return match


def _model_message(content: Content, i: int, ids: _CallIds, budget: ReasoningBudget) -> ChatMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    recovered: str | None = None
    calls: list[ToolCall] = []
    for j, part in enumerate(content.parts):
        if part.thoughtSignature:
            # The last one of ours wins: in a stream, the functionCall's signature covers all the reasoning.
            mine = decode_reasoning(part.thoughtSignature, param=f"contents.{i}.parts.{j}.thoughtSignature",
                                    budget=budget)
            recovered = mine if mine is not None else recovered
        if part.functionCall is not None:
            call = part.functionCall
            args = call.args or {}
            derived = ids.next(call.name, args)  # counted even when an id is given, so replies never reuse one
            call_id = call.id or derived
            calls.append(ToolCall(id=call_id, name=call.name, arguments=json.dumps(args, ensure_ascii=False)))
        elif part.text is not None:
            (thoughts if part.thought else texts).append(part.text)
        elif part.functionResponse is not None or part.inlineData is not None or part.fileData is not None:
            raise BadRequest("a model turn holds text, thoughts and functionCall parts only",
                             param=f"contents.{i}.parts.{j}")
        elif part.model_extra:
            logger.debug("gemini model part ignored: %s", sorted(part.model_extra))
    reasoning = recovered if recovered is not None else ("".join(thoughts) or None)
    return ChatMessage(role="assistant", content="".join(texts) or None, reasoning=reasoning, tool_calls=calls)


def _system_message(instruction: Content) -> ChatMessage:
    text = "\n".join(p.text for p in instruction.parts if p.text is not None)
    return ChatMessage(role="system", content=text)


# OpenAPI-only keywords Gemini accepts that JSON Schema does not have (``nullable`` is folded into ``type``).
_SCHEMA_DROPPED = {"propertyOrdering", "example", "nullable"}
# Keywords whose value is a schema or a list of schemas ...
_SUBSCHEMAS = {"items", "prefixItems", "additionalItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
               "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames"}
# ... and those whose value maps names to schemas.
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_UNSPECIFIED_TYPE = "type_unspecified"


def _json_type(value: Any) -> Any:
    """A ``type`` value with JSON Schema's lower-case names: a name, or a list of them; TYPE_UNSPECIFIED
    (no constraint) becomes None. Values of other shapes are left for the engine to judge."""
    if isinstance(value, str):
        name = value.lower()
        return None if name == _UNSPECIFIED_TYPE else name
    if isinstance(value, list):
        names = [v.lower() if isinstance(v, str) else v for v in value]
        names = [n for n in names if n != _UNSPECIFIED_TYPE]
        return names or None
    return value


def json_schema(schema: Any) -> Any:
    """A Gemini schema as JSON Schema, for vLLM's structured outputs and tool parameters.

    Gemini's OpenAPI subset (``responseSchema``, ``parameters``) and the JSON Schema fields
    (``responseJsonSchema``, ``parametersJsonSchema``) both may carry upper-case type names (``OBJECT``,
    ``STRING``, ``ARRAY``, ``INTEGER``, ``NUMBER``, ``BOOLEAN``, ``NULL``; ``TYPE_UNSPECIFIED`` means
    none): every ``type`` of the document, through ``properties``, ``items``, ``anyOf``, ``prefixItems``,
    ``$defs`` and the other subschema keywords, is lower-cased; ``nullable: true`` adds ``"null"`` to the
    type; ``propertyOrdering`` and ``example`` are dropped. Values of ``enum``, ``const``, ``default`` and
    the like are left alone. The caller's document is not modified (a new one is built).
    """
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true/false schemas, or something for the engine to refuse
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_DROPPED:
            continue
        if key == "type":
            kind = _json_type(value)
            if kind is not None:
                out["type"] = kind
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = json_schema(value)
        else:
            out[key] = value
    if schema.get("nullable") is True:
        kind = out.get("type")
        if isinstance(kind, str) and kind != "null":
            out["type"] = [kind, "null"]
        elif isinstance(kind, list) and "null" not in kind:
            out["type"] = [*kind, "null"]
    return out


def _tools(request: GenerateContentRequest) -> list[ToolDefinition]:
    tools: list[ToolDefinition] = []
    for i, tool in enumerate(request.tools or ()):
        hosted = sorted(tool.model_extra or ())
        if hosted:
            logger.info("gemini hosted tools dropped (the engine cannot run them): %s", hosted)
        for j, declaration in enumerate(tool.functionDeclarations or ()):
            field = "parametersJsonSchema" if declaration.parametersJsonSchema is not None else "parameters"
            parameters = json_schema(getattr(declaration, field))
            if parameters is not None and parameters.get("type", "object") != "object":
                raise BadRequest(f"function {declaration.name!r}: parameters must describe an object",
                                 param=f"tools.{i}.functionDeclarations.{j}.{field}")
            tools.append(ToolDefinition(name=declaration.name, description=declaration.description,
                                        parameters=parameters))
    return tools


def _tool_choice(config: ToolConfig | None) -> str | dict[str, Any] | None:
    calling = config.functionCallingConfig if config else None
    if calling is None or calling.mode in (None, "MODE_UNSPECIFIED"):
        return None
    if calling.mode == "NONE":
        return "none"
    if calling.mode == "ANY":
        names = calling.allowedFunctionNames or []
        if len(names) == 1:
            return {"type": "function", "function": {"name": names[0]}}
        return "required"  # several allowed names: the tool list stays whole so the prompt stays stable
    return "auto"


def _response_format(config: GenerationConfig) -> dict[str, Any] | None:
    if config.responseMimeType != "application/json":
        return None
    schema = json_schema(config.responseJsonSchema or config.responseSchema or None)
    if schema is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


# Gemini's thinking levels as the OpenAI-style reasoning_effort vLLM takes (it has no "minimal").
_EFFORTS = {"MINIMAL": "low", "LOW": "low", "MEDIUM": "medium", "HIGH": "high"}


def normalize(request: GenerateContentRequest, stream: bool) -> NormalizedRequest:
    """The internal request form of a Gemini request."""
    messages: list[ChatMessage] = []
    if request.systemInstruction is not None:
        messages.append(_system_message(request.systemInstruction))
    ids, orphans = _CallIds(), _CallIds()
    budget = ReasoningBudget()  # one per request: all its signatures together inflate within REQUEST_LIMIT
    pending: list[ToolCall] = []
    for i, content in enumerate(request.contents):
        if content.role == "model":
            message = _model_message(content, i, ids, budget)
            pending = list(message.tool_calls)
            messages.append(message)
        else:
            messages.extend(_user_messages(content, i, pending, orphans))
    config = request.generationConfig or GenerationConfig()
    thinking = config.thinkingConfig
    extra: dict[str, Any] = {}
    if (response_format := _response_format(config)) is not None:
        extra["response_format"] = response_format
    top = checked_top_logprobs(config.logprobs, "generationConfig.logprobs")
    if top and not config.responseLogprobs:
        raise BadRequest("generationConfig.logprobs needs responseLogprobs: true", param="generationConfig.logprobs")
    if top:
        extra["top_logprobs"] = top
    return NormalizedRequest(
        messages=messages,
        tools=_tools(request),
        tool_choice=_tool_choice(request.toolConfig),
        sampling=SamplingParams(temperature=config.temperature, top_p=config.topP, top_k=config.topK,
                                max_tokens=config.maxOutputTokens, seed=config.seed,
                                stop=list(config.stopSequences or ()), presence_penalty=config.presencePenalty,
                                frequency_penalty=config.frequencyPenalty, extra=extra),
        stream=stream,
        reasoning_effort=_EFFORTS.get((thinking.thinkingLevel or "").upper()) if thinking else None,
        chat_template_kwargs={"enable_thinking": False} if thinking and thinking.thinkingBudget == 0 else {},
    )


# -- replies -------------------------------------------------------------------------------------------

_FINISH_REASONS = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}


def _finish_reason(turn: EngineTurn, malformed: bool) -> str:
    if malformed:
        return "MALFORMED_FUNCTION_CALL"
    return _FINISH_REASONS.get(turn.finish_reason or "stop", "OTHER")


def _usage(turn: EngineTurn) -> dict[str, int]:
    u = turn.usage
    usage = {"promptTokenCount": u.prompt_tokens, "candidatesTokenCount": u.completion_tokens,
             "totalTokenCount": u.prompt_tokens + u.completion_tokens}
    if u.cached_tokens:
        usage["cachedContentTokenCount"] = u.cached_tokens
    return usage


class GeminiRenderer:
    """Renders one call's reply, whole or streamed (SSE or JSON-array framing), in Gemini's shape."""

    def __init__(self, request: GenerateContentRequest, model: str, sse: bool) -> None:
        self.model = model
        self.sse = sse
        thinking = request.generationConfig.thinkingConfig if request.generationConfig else None
        self.include_thoughts = bool(thinking and thinking.includeThoughts)
        self.response_id = uuid.uuid4().hex[:22]
        self._ids = _CallIds()  # ids a reply's calls will get when the history comes back
        for content in request.contents:
            for part in content.parts if content.role == "model" else ():
                if part.functionCall is not None:
                    self._ids.next(part.functionCall.name, part.functionCall.args or {})
        self._reasoning: list[str] = []
        self._signed = False
        self._chunks_sent = 0
        config = request.generationConfig
        self.logprobs = bool(config and config.responseLogprobs)
        self._values: list[float | None] = []  # a stream's logprobs so far (avgLogprobs at its end)
        self._held = EngineDelta()  # tokens of deltas with no part of their own (tool-call pieces)

    # parts ---------------------------------------------------------------------------------------------
    def _signature(self) -> str | None:
        return encode_reasoning("".join(self._reasoning)) if self._reasoning else None

    def _text_part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"text": text}
        if not self._signed and (signature := self._signature()) is not None:
            part["thoughtSignature"] = signature
            self._signed = True
        return part

    def _call_parts(self, turn: EngineTurn) -> tuple[list[dict[str, Any]], bool]:
        parts: list[dict[str, Any]] = []
        malformed = False
        signature = self._signature()
        for call in turn.tool_calls:
            args = arguments_object(call.arguments)
            if args is None:
                logger.warning("engine tool call %s has arguments that are not a JSON object within the depth "
                               "bound: %.200s", call.name, call.arguments)
                malformed = True
                continue
            part: dict[str, Any] = {"functionCall": {"name": call.name, "args": args,
                                                     "id": self._ids.next(call.name, args)}}
            if signature is not None and not parts:
                part["thoughtSignature"] = signature
            parts.append(part)
        return parts, malformed

    def _document(self, parts: list[dict[str, Any]], turn: EngineTurn | None = None,
                  malformed: bool = False, tokens: EngineDelta | EngineTurn | None = None) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        document: dict[str, Any] = {"candidates": [candidate]}
        if self.logprobs and tokens is not None and tokens.logprobs:
            candidate["logprobsResult"] = gemini_logprobs(tokens.logprobs, tokens.logprob_entries, tokens.token_ids)
        if turn is not None:
            candidate["finishReason"] = _finish_reason(turn, malformed)
            document["usageMetadata"] = _usage(turn)
            if self.logprobs and (mean := average(self._values or turn.logprobs)) is not None:
                candidate["avgLogprobs"] = mean
        document["modelVersion"] = self.model
        document["responseId"] = self.response_id
        return document

    # whole ---------------------------------------------------------------------------------------------
    def response(self, turn: EngineTurn) -> dict[str, Any]:
        parts: list[dict[str, Any]] = []
        if turn.reasoning:
            self._reasoning = [turn.reasoning]
            if self.include_thoughts:
                parts.append({"text": turn.reasoning, "thought": True})
        if turn.content:
            parts.append(self._text_part(turn.content))
        calls, malformed = self._call_parts(turn)
        parts += calls
        if not parts:
            parts.append(self._text_part(""))
        return self._document(parts, turn, malformed, tokens=turn)

    # streamed ------------------------------------------------------------------------------------------
    def _frame(self, document: dict[str, Any]) -> bytes:
        body = orjson.dumps(document)
        self._chunks_sent += 1
        if self.sse:
            return b"data: " + body + b"\r\n\r\n"
        return (b"[" if self._chunks_sent == 1 else b",\r\n") + body

    def stream_delta(self, delta: EngineDelta) -> list[bytes]:
        """Thought and text parts as they come; tool-call pieces wait for the closing chunk."""
        parts: list[dict[str, Any]] = []
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
            if self.include_thoughts:
                parts.append({"text": delta.reasoning, "thought": True})
        if delta.content:
            parts.append(self._text_part(delta.content))
        if self.logprobs and delta.logprobs:
            self._values += delta.logprobs
            if not parts:
                self._held = _joined(self._held, delta)
                return []
            delta = _joined(self._held, delta)
            self._held = EngineDelta()
        return [self._frame(self._document(parts, tokens=delta))] if parts else []

    def stream_finish(self, turn: EngineTurn) -> list[bytes]:
        """The closing chunk: whole functionCall parts, finishReason and usageMetadata (then ``]``)."""
        parts, malformed = self._call_parts(turn)
        if not self._signed and not parts and (signature := self._signature()) is not None:
            # Reasoning only (e.g. cut by the token limit): the signature still has to reach the client.
            parts.append({"text": "", "thought": True, "thoughtSignature": signature})
        chunks = [self._frame(self._document(parts, turn, malformed, tokens=self._held))]
        if not self.sse:
            chunks.append(b"]")
        return chunks

    def stream_whole(self, turn: EngineTurn) -> list[bytes]:
        """A synthetic stream for a turn the engine returned whole."""
        tokens = EngineDelta(content=turn.content, reasoning=turn.reasoning, token_ids=turn.token_ids,
                             logprobs=turn.logprobs, logprob_entries=turn.logprob_entries)
        return self.stream_delta(tokens) + self.stream_finish(turn)

    def stream_error(self, error: ProxyError) -> list[bytes]:
        """A failure after the stream started. With ``alt=sse`` it is the bare error object on a line of
        its own, as Google ends a failed stream: ``@google/genai`` (JS) raises an ``ApiError`` with its
        code only for that; a ``data:`` event holding an error reads as a chunk without candidates, so
        Gemini CLI took a failed stream for one that lacked a finish reason (see the module docstring)."""
        if self.sse:
            return [orjson.dumps(error_body(error)) + b"\n"]
        return [self._frame(error_body(error)), b"]"]


def _joined(first: EngineDelta, then: EngineDelta) -> EngineDelta:
    """The sampled tokens of two deltas, in order (their text is not needed here)."""
    if not first.logprobs:
        return then
    entries = first.logprob_entries + then.logprob_entries \
        if usable(first.logprobs, first.logprob_entries) and usable(then.logprobs, then.logprob_entries) else []
    return EngineDelta(token_ids=first.token_ids + then.token_ids, logprobs=first.logprobs + then.logprobs,
                       logprob_entries=entries)


# -- errors --------------------------------------------------------------------------------------------

_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
           405: "UNIMPLEMENTED", 413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 426: "FAILED_PRECONDITION",
           429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def error_body(error: ProxyError) -> dict[str, Any]:
    """Google's error object (``google.rpc.Status`` as JSON), naming the offending field when known."""
    body: dict[str, Any] = {"code": error.status_code, "message": error.message,
                            "status": _STATUS.get(error.status_code, "INTERNAL")}
    if error.param:
        body["details"] = [{"@type": "type.googleapis.com/google.rpc.BadRequest",
                            "fieldViolations": [{"field": error.param, "description": error.message}]}]
    return {"error": body}


class GeminiApi:
    """``POST /v1beta/models/{model}:generateContent`` and ``:streamGenerateContent?alt=sse``."""

    name: ProviderApi = "gemini"
    stream_media_type = "text/event-stream"

    def parse(self, document: Any, route: Route) -> ParsedCall:
        wire = parse_request(document)
        model = (route.model or "").removeprefix("models/") or "gemini"
        stream = bool(route.stream)
        renderer = GeminiRenderer(wire, model, sse=route.query.get("alt") == "sse")
        return ParsedCall(requested_model=model, request=normalize(wire, stream), renderer=renderer)

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        return error_body(error)
