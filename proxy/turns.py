"""The engine's reply as the proxy works with it: a whole :class:`EngineTurn`, or streamed
:class:`EngineDelta` chunks that a :class:`TurnAssembler` folds into the same turn; the sampled and prompt
ids, their logprobs, the parsed text and tool calls, and what ended the turn.

Every provider API renders its reply from these, and the capture builds the completion event from them;
the engine client (:mod:`proxy.engine`) and the token API (:mod:`proxy.continuation.token_api`) make them.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.arrays import TokenIds
from schemas.completions import ToolCall, Usage


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class EngineDelta:
    """One streamed chunk of the engine's reply, with the tokens it carries."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    # The engine's own entry per sampled token (``logprobs.content[i]``, kept as it came: token string,
    # bytes, top alternatives), for a harness that asked for logprobs; ``logprobs`` holds their values.
    logprob_entries: list[dict[str, Any]] = field(default_factory=list)
    prompt_token_ids: Sequence[int] | None = None
    # The prompt ids as the engine wrote them (a JSON array), not yet read into ids: a long prompt's take
    # milliseconds to read, which the chunk's first bytes to the harness need not wait for.
    prompt_ids_text: bytes | None = None
    usage: Usage | None = None

    @property
    def has_text(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    @property
    def prompt_length(self) -> int:
        """How many prompt ids the chunk carries (counted in their text while it is not read yet)."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        text = self.prompt_ids_text
        if text is None:
            return 0
        commas = text.count(b",")
        return commas + 1 if commas or text.strip(b"[] \t\r\n") else 0


@dataclass(slots=True)
class EngineTurn:
    """The engine's whole reply to one call."""

    prompt_token_ids: Sequence[int]  # a list, or the packed array a stream's ids are read into
    token_ids: list[int]
    logprobs: list[float | None]
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    usage: Usage
    response_id: str | None = None
    # What stopped a "stop" turn, as vLLM says it: None for the tokenizer's end of sequence, an id for one of
    # the other end ids (the generation config's, the request's stop_token_ids), a string for a stop string.
    stop_reason: int | str | None = None
    # The prompt ids already packed for the event (a stream reads them into it during the stream, off the
    # end of the call where the event is written); None: packed when the event is built.
    packed_prompt: TokenIds | None = None
    # Why the engine's prompt ids could not be read (not an array of token ids); the turn is then unusable.
    prompt_error: str | None = None
    # The engine's entry per sampled token (see EngineDelta.logprob_entries), for a whole reply; empty when
    # it gave none, and for a streamed one, whose entries went out with their chunks and are not kept (a
    # long reply's entries are hundreds of bytes a token).
    logprob_entries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ends_on_end_id(self) -> bool:
        """The model sampled one of the engine's end ids, the last sampled id, which closes the turn."""
        return ends_on_end_id(self.finish_reason, self.stop_reason, self.token_ids)


def ends_on_end_id(finish_reason: str | None, stop_reason: int | str | None, token_ids: list[int]) -> bool:
    """Whether a turn stopped on one of the engine's end ids, its last sampled id.

    vLLM's end ids are the tokenizer's end of sequence (``stop_reason`` None), and the generation config's
    other end ids and the request's ``stop_token_ids`` (``stop_reason`` that id). vLLM keeps the id in the
    sampled ids and their logprobs but never decodes it into the reply's text; the chat template's turn is
    closed by it. A stop *string* (``stop_reason`` a string) is text: the turn it cuts is not closed.
    """
    if finish_reason not in ("stop", "tool_calls") or not token_ids:
        return False
    if stop_reason is None:
        return True
    return isinstance(stop_reason, int) and not isinstance(stop_reason, bool) and token_ids[-1] == stop_reason


class TurnAssembler:
    """Folds streamed deltas into an :class:`EngineTurn`."""

    def __init__(self) -> None:
        self.prompt_token_ids: Sequence[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, ToolCallDelta] = {}
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: Usage | None = None
        self.packed_prompt: TokenIds | None = None
        self.prompt_error: str | None = None
        self._prompt_text: bytes | None = None

    def add(self, delta: EngineDelta) -> None:
        if delta.prompt_token_ids is not None:
            self._take_prompt(delta.prompt_token_ids)
        elif delta.prompt_ids_text is not None:
            self._prompt_text, self.prompt_token_ids, self.packed_prompt = delta.prompt_ids_text, [], None
            self.prompt_error = None
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.content:
            self._content.append(delta.content)
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        for part in delta.tool_calls:
            call = self._calls.setdefault(part.index, ToolCallDelta(part.index))
            call.id = call.id or part.id
            call.name = call.name or part.name
            call.arguments += part.arguments
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
        if delta.usage is not None:
            self.usage = delta.usage

    @property
    def prompt_pending(self) -> bool:
        """The engine's prompt ids came as text that :meth:`settle_prompt` has not read yet."""
        return self._prompt_text is not None

    def settle_prompt(self) -> None:
        """Read the prompt ids the engine wrote into their packed array (nothing if already done)."""
        text, self._prompt_text = self._prompt_text, None
        if text is None:
            return
        try:
            ids = read_token_ids(text)
        except ValueError as exc:
            self.prompt_error = (f"engine sent prompt_token_ids that are not token ids ({exc}): "
                                 f"{text[:200].decode(errors='replace')}")
            return
        self.prompt_token_ids = self.packed_prompt = ids

    def _take_prompt(self, values: Sequence[int]) -> None:
        self.prompt_token_ids = values
        try:
            self.packed_prompt = packed_token_ids(values)
        except Exception:  # not ids at all: the event's own build says so (proxy/capture.py)
            self.packed_prompt = None

    def turn(self) -> EngineTurn:
        self.settle_prompt()
        calls = [ToolCall(id=c.id or f"call_{i}", name=c.name or "", arguments=c.arguments)
                 for i, c in sorted(self._calls.items())]
        usage = self.usage or Usage(prompt_tokens=len(self.prompt_token_ids), completion_tokens=len(self.token_ids))
        return EngineTurn(self.prompt_token_ids, self.token_ids, self.logprobs, "".join(self._content) or None,
                          "".join(self._reasoning) or None, calls, self.finish_reason, usage,
                          stop_reason=self.stop_reason, packed_prompt=self.packed_prompt,
                          prompt_error=self.prompt_error)


def read_token_ids(text: bytes) -> TokenIds:
    """Token ids from the JSON array the engine wrote, read straight into an array: no Python int per id
    (a long prompt's ids are the most a call parses). ValueError, saying what is wrong, for anything but a
    flat array of integers in [0, 2**31)."""
    body = text.strip()
    if body[:1] != b"[" or body[-1:] != b"]":
        raise ValueError("not a JSON array")
    inner = body[1:-1].strip()
    if not inner:
        return TokenIds([])
    # numpy's reader takes what JSON does not (a trailing comma; before numpy 2, anything after the last
    # number it could read, with a warning), so the ends and the count are checked here. No warnings filter:
    # it would be the whole process's, every thread's, while it lasted.
    if not (inner[:1].isdigit() or inner[:1] == b"-") or not inner[-1:].isdigit():
        raise ValueError("not an array of integers")
    values = np.fromstring(inner, dtype=np.int64, sep=",")
    if len(values) != inner.count(b",") + 1:
        raise ValueError("not an array of integers")
    return TokenIds(values)  # refuses ids out of range


def packed_token_ids(values: Sequence[int]) -> TokenIds:
    """The engine's token ids as the event's packed array, through ``array.array`` (C, and strict: a
    float, a string or an id past int32 is refused there); what it refuses goes through ``TokenIds``'s own
    checks, which say what is wrong. About half the cost of TokenIds(list) for a 38k-token prompt."""
    try:
        buffer = array.array("i", values)
    except (TypeError, OverflowError):
        return TokenIds(values)
    return TokenIds(np.frombuffer(buffer, dtype=np.intc))
