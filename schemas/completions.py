"""Completions: one event per model call, with the exact tokens the engine used and produced.

The request is recorded in one internal chat form, whatever provider API the harness spoke (the proxy
normalizes into it). Token ids and logprobs are the engine's own, never re-tokenized from text, and are
stored as packed arrays (see schemas/arrays.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from schemas.arrays import Logprobs, TokenIds
from schemas.envelope import Event, Model
from schemas.topics import Topic

ProviderApi = Literal["openai.chat", "openai.responses", "anthropic.messages", "gemini"]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(Model):
    """One part of a message's content in the internal form."""

    type: Literal["text", "image"]
    text: str | None = None
    media_type: str | None = None
    data: str | None = Field(default=None, description="Image bytes (base64) or URL.")


class ToolCall(Model):
    """A tool call the assistant made; ``arguments`` is the JSON (or freeform) text as sampled."""

    id: str
    name: str
    arguments: str
    kind: Literal["function", "custom"] = "function"


class ChatMessage(Model):
    """A message in the internal chat form."""

    role: Role
    content: str | list[ContentPart] | None = None
    reasoning: str | None = Field(default=None, description="Reasoning text echoed back by the harness.")
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = Field(default=None, description="For role 'tool': the call answered.")
    name: str | None = None
    is_error: bool | None = Field(default=None, description="For role 'tool': the tool reported an error.")


class ToolDefinition(Model):
    """A tool offered to the model."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON Schema of the arguments.")
    kind: Literal["function", "custom"] = "function"
    grammar: dict[str, Any] | None = Field(default=None, description="For freeform (custom) tools.")


class SamplingParams(Model):
    """Sampling parameters as sent to the engine (after the session's overrides)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    extra: dict[str, Any] = Field(default_factory=dict, description="Engine extras, e.g. structured_outputs.")


class NormalizedRequest(Model):
    """A model call in the one internal form every provider API maps into."""

    messages: list[ChatMessage]
    tools: list[ToolDefinition] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class AssistantMessage(Model):
    """The assistant turn as the engine's parsers returned it."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class Usage(Model):
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)


class CallTimings(Model):
    """Wall-clock points of one call (UTC) and derived durations in milliseconds."""

    received_at: datetime
    upstream_started_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    ttft_ms: float | None = Field(default=None, ge=0)
    total_ms: float | None = Field(default=None, ge=0)


CallErrorKind = Literal["bad_request", "payload_too_large", "unknown_session", "engine_unavailable",
                       "engine_timeout", "context_overflow", "engine_error", "capture_failed", "client_disconnected",
                       "internal"]


class CallError(Model):
    """Why a call failed."""

    kind: CallErrorKind
    message: str
    http_status: int | None = None


DriftKind = Literal["template", "retokenized_text", "reasoning_stripped", "tool_arguments_reserialized", "other"]
BranchRole = Literal["main", "sub_agent", "side"]


class Drift(Model):
    """How a full re-render of the call's history differs from the exact prompt it was sent as.

    Kinds: ``reasoning_stripped`` (a continued assistant turn's reasoning is missing from the re-render:
    the harness did not send it back, or the template drops it); ``tool_arguments_reserialized`` (the
    arguments the harness sent back are not the text the model sampled, e.g. ``{"a":1}`` → ``{"a": 1}``);
    ``retokenized_text`` (the same text, other token ids: BPE re-segmentation of sampled text);
    ``template`` (the difference lies outside the sampled spans: template glue, special tokens);
    ``other``."""

    differs: bool
    kinds: list[DriftKind] = Field(default_factory=list)
    first_divergence: int | None = Field(default=None, description="First token index where they differ.")
    rendered_prompt_tokens: int = Field(ge=0, description="Length of the full re-render.")


class Continuation(Model):
    """How the proxy built this call's prompt, and which branch of the session it belongs to."""

    mode: Literal["exact", "rendered"] = Field(description=(
        "'exact': the parent's prompt + sampled ids + the new messages' tokens; 'rendered': the chat "
        "template over the whole history (a new branch, or a session in rendered mode)."))
    branch: str = Field(description="Branch id within the session (b0, b1, ...).")
    role: BranchRole = "main"
    parent_sequence: int | None = Field(default=None, description="The call whose tokens this prompt extends.")
    prefix_tokens: int = Field(default=0, ge=0, description="Tokens taken unchanged from the parent.")
    new_tokens: int = Field(default=0, ge=0, description="Tokens rendered for the new messages + generation prompt.")
    closed_cut_turn: bool = Field(default=False, description=(
        "The parent's turn was cut by the token limit; its close token was added (never sampled)."))
    opened: str | None = Field(default=None, description=(
        "Why this call opened a new branch instead of continuing one (first_call, history_differs, "
        "tools_differ, assistant_in_new_messages, fork, ...), or why an exact continuation fell back to a "
        "full render (engine_has_no_token_api, render_not_prefix, ...)."))
    retry_of_sequence: int | None = Field(default=None, description=(
        "This call re-asks the parent's successor turn: that call's sample was abandoned."))
    drift: Drift | None = None


class Completion(Event):
    """One model call: who made it, what was asked, and the engine's exact tokens and logprobs."""

    topic: ClassVar[Topic] = Topic.COMPLETIONS
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["completion"] = "completion"
    schema_version: Literal[1] = 1
    session_id: str = Field(min_length=1)
    task_id: str | None = None
    sequence: int = Field(ge=0, description="Per-session call number, in the order the proxy received them.")
    agent_hints: dict[str, str] = Field(default_factory=dict, description=(
        "Lineage hints from the harness (e.g. its own session or agent ids, parent call)."))
    api: ProviderApi
    requested_model: str | None = None
    served_model: str | None = None
    policy_version: str | None = None
    request: NormalizedRequest
    request_digest: str | None = Field(default=None, description="sha256 of the original request body.")
    request_body: str | None = Field(default=None, description=(
        "The original request body as the harness sent it (UTF-8 JSON), when the proxy keeps bodies "
        "(ROLLWIRE_RECORD_REQUEST_BODY); the normalized `request` is always there."))
    retry_of: int | None = Field(default=None, description="Sequence of the call this one retries.")
    retry_count: int = Field(default=0, ge=0)
    status: Literal["ok", "error"] = "ok"
    error: CallError | None = None
    prompt_token_ids: TokenIds | None = None
    token_ids: TokenIds | None = None
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    message: AssistantMessage | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: CallTimings | None = None
    continuation: Continuation | None = Field(default=None, description=(
        "How the prompt was built (exact continuation or full render), its branch and the measured drift; "
        "None for calls recorded before the proxy built prompts itself, and for refused calls."))
    weight_versions: list[dict[str, Any]] | None = Field(default=None, description=(
        "The engine's weight version spans over the sampled tokens, when the engine reports them."))

    @model_validator(mode="after")
    def _consistent(self) -> Completion:
        if self.logprobs is not None and (self.token_ids is None or len(self.logprobs) != len(self.token_ids)):
            raise ValueError("logprobs must have one value per sampled token id")
        if self.status == "error" and self.error is None:
            raise ValueError("a failed completion must say why (error)")
        return self
