"""Completions: one event per model call, with the exact tokens the engine used and produced.

The request is recorded in one internal chat form, whatever provider API the harness spoke (the proxy
normalizes into it). Token ids and logprobs are the engine's own, never re-tokenized from text, and are
stored as packed arrays (see schemas/arrays.py).

Schema versions (how they are introduced and retired: schemas/versions.py):

- **1**: every event carries its whole prompt: all ``prompt_token_ids`` and every ``request.messages``.
- **2** (written now): an event may be a **delta** (``prompt_delta`` set) against an earlier completion of
  the same session, its parent. Then ``prompt_token_ids`` holds only the tokens after the first
  ``prompt_delta.prefix_tokens`` of the parent's prompt + sampled ids, and ``request.messages`` only the
  messages after the first ``prompt_delta.messages_prefix`` of the parent's (resolved) messages.
  ``request.tools`` is inherited from the parent when ``prompt_delta.tools_inherited`` (the delta's own list
  is then empty); the request's other fields (``tool_choice``, ``sampling``, ``stream``,
  ``reasoning_effort``, ``chat_template_kwargs``) and everything outside ``request`` are always the event's
  own, written whole. A keyframe (``prompt_delta`` None) is a full event as in version 1; a v1 event is a
  keyframe. :func:`schemas.prompt_chain.resolve_session` and :class:`schemas.prompt_chain.PromptChains`
  turn deltas back into full events; every consumer reads prompts through them.
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
                       "proxy_stopped", "internal"]


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


class Restore(Model):
    """The read of the session's log that came before this call: another proxy process served some of its
    earlier calls (or this one did before it was started again), so their branches were read back first."""

    ms: float = Field(ge=0, description="How long the read took (the call waited for it).")
    bytes_read: int = Field(ge=0, description="Bytes of the session's partition of completions read.")
    records_read: int = Field(ge=0, description="Records read (any session's: the partition is shared).")
    replayed: int = Field(ge=0, description="Calls of this session replayed into its branches.")


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
    restore: Restore | None = Field(default=None, description=(
        "Set when the session's log was read before this call was placed (see docs/proxy-tier.md)."))


class PromptDelta(Model):
    """What a delta event takes from its parent (see the module docstring): the full prompt is the parent's
    ``(prompt_token_ids + token_ids)[:prefix_tokens]`` + this event's ``prompt_token_ids``; the full
    messages are the parent's ``request.messages[:messages_prefix]`` + this event's ``request.messages``."""

    parent_event_id: str = Field(min_length=1, max_length=128, description=(
        "The parent completion's event id: an event of the same session written before this one (same key, "
        "so earlier in the same partition). Usually an earlier call; a call that ran beside its parent's "
        "may name one with a higher sequence."))
    parent_sequence: int = Field(ge=0, description="The parent's sequence (a check on the reference).")
    prefix_tokens: int = Field(ge=0, description="Tokens taken from the parent's prompt + sampled ids.")
    messages_prefix: int = Field(ge=0, description="Messages taken from the parent's request.messages.")
    tools_inherited: bool = Field(default=False, description=(
        "request.tools is the parent's (equal as JSON); this event's own list is empty."))
    prompt_tokens: int = Field(ge=0, description=(
        "Length of the resolved prompt: prefix_tokens + len(prompt_token_ids), checked on resolution."))


class Completion(Event):
    """One model call: who made it, what was asked, and the engine's exact tokens and logprobs."""

    topic: ClassVar[Topic] = Topic.COMPLETIONS
    key_field: ClassVar[str] = "session_id"

    event_type: Literal["completion"] = "completion"
    schema_version: Literal[1, 2] = 2
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
    engine: str | None = Field(default=None, description=(
        "The engine that served the call (its configured name, else its URL): stable across restarts, so a "
        "session's engine pin can be read back from its last completion."))
    stop_reason: int | str | None = Field(default=None, description=(
        "What stopped a 'stop' turn, as vLLM says it: absent for the tokenizer's end of sequence, the token id "
        "for another end id (the generation config's, the request's stop_token_ids), the text for a stop "
        "string. With finish_reason and token_ids it tells whether the turn was closed by a sampled id."))
    proxy: str | None = Field(default=None, max_length=256, description=(
        "The proxy process that served the call (its name within the tier, ROLLWIRE_PROXY_INSTANCE)."))
    engine_attempts: int = Field(default=1, ge=1, description=(
        "Engines the call was sent to: more than 1 when an engine refused it before sampling anything and "
        "another served it."))
    prompt_delta: PromptDelta | None = Field(default=None, description=(
        "Version 2: set on a delta event (prompt_token_ids and request.messages hold only what is new; "
        "resolve with schemas.prompt_chain), None on a keyframe."))

    @model_validator(mode="after")
    def _consistent(self) -> Completion:
        if self.logprobs is not None and (self.token_ids is None or len(self.logprobs) != len(self.token_ids)):
            raise ValueError("logprobs must have one value per sampled token id")
        if self.status == "error" and self.error is None:
            raise ValueError("a failed completion must say why (error)")
        delta = self.prompt_delta
        if delta is not None:
            if self.schema_version < 2:
                raise ValueError("prompt_delta needs schema_version 2")
            if self.prompt_token_ids is None:
                raise ValueError("a delta completion carries its new prompt tokens (prompt_token_ids, maybe empty)")
            if delta.prompt_tokens != delta.prefix_tokens + len(self.prompt_token_ids):
                raise ValueError(f"prompt_delta.prompt_tokens {delta.prompt_tokens} is not prefix_tokens "
                                 f"{delta.prefix_tokens} + {len(self.prompt_token_ids)} new tokens")
            if delta.parent_event_id == self.event_id:
                raise ValueError("a delta cannot be its own parent")
            if delta.tools_inherited and self.request.tools:
                raise ValueError("a delta that inherits its tools carries none of its own")
        return self
