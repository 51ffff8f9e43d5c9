"""Prompt chains: writing a completion as a delta against its parent, and resolving deltas to full prompts.

A session's calls under exact-token continuation extend each other token for token, so a v2 completion
may carry only what is new (:class:`schemas.completions.PromptDelta`; the rule for what a delta inherits is
in ``schemas/completions.py``). This module is the one place that turns deltas back into full events,
and the one place that writes them:

- :func:`resolve_session` (pure): a session's completions, in any order, with every delta resolved, and
  the ones whose parent is not there (:class:`MissingParent`, with the reason; a child of a missing
  parent is missing too).
- :class:`PromptChains`: the same for a consumer reading a partition in order, one event at a time, with
  a bounded cache of recent events' full prompts (``max_bytes``): :meth:`PromptChains.resolve` gives the
  full event or raises :class:`MissingPromptParent` (the consumer dead-letters the child with the reason,
  or counts it; it never builds a row from a half prompt).
- :func:`delta_against` writes a full event as a delta against its parent's :class:`ChainLink` (what the
  proxy remembers per branch), or leaves it a keyframe; :func:`write_session` does that for a whole
  session as the proxy does (benchmarks, tests).

Keyframes (chosen with ``python -m bench.log_size --sweep``, Qwen-Code-shaped sessions: its 39 kB tool
list and system prompt, ~2k-token tool outputs): a keyframe when the prompt has grown past
:data:`KEYFRAME_GROWTH` (4) times its chain keyframe's tokens, and at the latest every
:data:`KEYFRAME_EVERY` (64) events. The growth rule keeps the log linear in tokens (keyframes at
geometrically spaced sizes sum to under 4/3 of the last one, so they add at most about 1.3 times the
session's distinct tokens) and keeps a cold reader's walk to about one full prompt of bytes; the event cap bounds how many records a walk reads and how much of a chain one
damaged record takes down. A fixed interval alone grows as turns² / K: K=32 gave 13.2x at 50 turns and
14.4x at 100 (exponent 1.21); K=64 with growth 4 gives 15.4x and 19.5x (exponent 1.04, against 1.65 for
full events), with a worst walk of 62 events (1.0 MB, about one and a half full events) at 100 turns.

A delta is lossless by construction: the shared prefix is measured, not assumed (tokens compared with
the parent's prompt + sampled ids, messages compared for equality with the parent's messages, tools
compared as JSON), so resolving gives back exactly the event that was delta-encoded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from pydantic import TypeAdapter

from schemas.arrays import TokenIds
from schemas.completions import ChatMessage, Completion, PromptDelta, ToolDefinition

KEYFRAME_EVERY = 64
"""At most this many events per chain: a keyframe, then up to ``KEYFRAME_EVERY - 1`` deltas."""

KEYFRAME_GROWTH = 4.0
"""A keyframe also when the prompt has grown past this many times the chain keyframe's tokens."""

DELTA_OVERHEAD_BYTES = 256
"""What the delta's own fields cost on the wire, about: a delta that would save less is not written."""

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024

_TOOLS: TypeAdapter[list[ToolDefinition]] = TypeAdapter(list[ToolDefinition])
_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False


class MissingPromptParent(LookupError):
    """A delta's parent cannot be had: never seen (retention deleted it, it was never written), evicted from
    the reader's cache, itself unresolvable, or not the event the delta describes (a corrupted record)."""

    error_type = "missing_prompt_parent"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MissingParent:
    """A completion that could not be resolved, and why."""

    completion: Completion
    reason: str


@dataclass(frozen=True, slots=True)
class PromptChain:
    """A session's completions resolved: ``resolved`` in input order (full prompts, ``prompt_delta`` None),
    ``missing`` those whose chain is broken."""

    resolved: list[Completion]
    missing: list[MissingParent]


def _message_chars(message: ChatMessage) -> int:
    content = message.content
    size = len(content) if isinstance(content, str) else sum(len(p.text or p.data or "") for p in content or ())
    return size + len(message.reasoning or "") + sum(len(c.arguments) + len(c.name) for c in message.tool_calls)


@dataclass(frozen=True, slots=True)
class ChainLink:
    """What a child needs of its resolved parent: the parent's prompt + sampled ids, messages and tools."""

    event_id: str
    session_id: str
    sequence: int
    tokens: np.ndarray  # read-only int32: prompt + sampled ids
    messages: tuple[ChatMessage, ...]
    tools: list[ToolDefinition]
    depth: int  # deltas since the chain's keyframe (0: a keyframe)
    keyframe_tokens: int  # prompt + sampled ids of the chain's keyframe
    text_bytes: int = 0  # text of the messages this link holds that its parent did not (roughly, in chars)

    @classmethod
    def of(cls, full: Completion, depth: int = 0, tokens: np.ndarray | None = None,
           own_messages: Sequence[ChatMessage] | None = None, *, keyframe_tokens: int | None = None) -> ChainLink:
        """The link of a full (resolved) completion (``tokens``: its prompt + sampled ids, when at hand;
        ``own_messages``: the messages it does not share with its parent, default all;
        ``keyframe_tokens``: its chain keyframe's tokens, default its own: it is the keyframe)."""
        if tokens is None:
            prompt = full.prompt_token_ids.numpy if full.prompt_token_ids is not None else _EMPTY
            sampled = full.token_ids.numpy if full.token_ids is not None else _EMPTY
            tokens = np.concatenate([prompt, sampled]).astype(np.int32, copy=False) if len(sampled) else prompt
            if tokens.flags.writeable:
                tokens.flags.writeable = False
        own = full.request.messages if own_messages is None else own_messages
        return cls(full.event_id, full.session_id, full.sequence, tokens, tuple(full.request.messages),
                   full.request.tools, depth, len(tokens) if keyframe_tokens is None else keyframe_tokens,
                   sum(_message_chars(m) for m in own))

    @property
    def approx_bytes(self) -> int:
        """What holding this link costs, roughly: its tokens, its message list, and the text of the messages
        it added (the rest is shared with its parent's link)."""
        return int(self.tokens.nbytes) + 8 * len(self.messages) + self.text_bytes + 512


def is_delta(completion: Completion) -> bool:
    """Whether ``completion`` is a delta (its prompt must be resolved before use)."""
    return completion.prompt_delta is not None


# -- resolving --------------------------------------------------------------------------------------------

def _resolve_with(child: Completion, parent: ChainLink) -> tuple[Completion, np.ndarray]:
    """``child`` (a delta) made full from its parent's link, and its prompt + sampled ids (one buffer, the
    prompt a view of it); MissingPromptParent when they do not fit."""
    delta = child.prompt_delta
    assert delta is not None and child.prompt_token_ids is not None
    if parent.event_id != delta.parent_event_id:
        raise MissingPromptParent(f"parent {delta.parent_event_id} expected, {parent.event_id} given")
    if parent.session_id != child.session_id:
        raise MissingPromptParent(f"parent {parent.event_id} belongs to session {parent.session_id!r}, not "
                                  f"{child.session_id!r}: a chain never crosses sessions")
    if parent.sequence != delta.parent_sequence:
        raise MissingPromptParent(f"parent {parent.event_id} has sequence {parent.sequence}, the delta names "
                                  f"{delta.parent_sequence} (a corrupted record?)")
    if delta.prefix_tokens > len(parent.tokens) or delta.messages_prefix > len(parent.messages):
        raise MissingPromptParent(
            f"the delta takes {delta.prefix_tokens} tokens and {delta.messages_prefix} messages from parent "
            f"{parent.event_id}, which has {len(parent.tokens)} and {len(parent.messages)} (a corrupted record?)")
    new = child.prompt_token_ids.numpy
    sampled = child.token_ids.numpy if child.token_ids is not None else _EMPTY
    prefix, end = delta.prefix_tokens, delta.prefix_tokens + len(new)
    tokens = np.empty(end + len(sampled), dtype=np.int32)
    tokens[:prefix] = parent.tokens[:prefix]
    tokens[prefix:end] = new
    tokens[end:] = sampled
    tokens.flags.writeable = False
    request = child.request.model_copy(update={
        "messages": [*parent.messages[:delta.messages_prefix], *child.request.messages],
        "tools": parent.tools if delta.tools_inherited else child.request.tools,
    })
    full = child.model_copy(update={"prompt_token_ids": TokenIds(tokens[:end]), "request": request,
                                    "prompt_delta": None})
    return full, tokens


def _parent_missing_reason(delta: PromptDelta, why: str) -> str:
    return f"parent {delta.parent_event_id} (sequence {delta.parent_sequence}) {why}"


def resolve_session(completions: Sequence[Completion]) -> PromptChain:
    """Every completion of ``completions`` with its prompt resolved, in input order (any order in, parents
    before or after their children; re-delivered copies of one event resolve alike). Pure: no I/O."""
    by_id: dict[str, Completion] = {}
    for completion in completions:
        by_id.setdefault(completion.event_id, completion)
    links: dict[str, ChainLink] = {}
    full: dict[str, Completion] = {}
    broken: dict[str, str] = {}

    def resolve(event_id: str) -> None:
        # Walk up to a resolved link, a keyframe or a break, then resolve back down (no recursion: chains
        # may be long). ``broken`` keeps each event's root cause, so reasons do not nest down a chain.
        path: list[Completion] = []
        on_path: set[str] = set()
        current: str | None = event_id
        root: str | None = None
        while current is not None and current not in links:
            if current in broken:
                root = broken[current]
                break
            event = by_id.get(current)
            if event is None:
                child = path[-1]
                assert child.prompt_delta is not None
                root = _parent_missing_reason(child.prompt_delta, "is not among the session's completions")
                break
            if current in on_path:
                root = f"the prompt chain through {current} loops (a corrupted record?)"
                break
            path.append(event)
            on_path.add(current)
            current = event.prompt_delta.parent_event_id if event.prompt_delta is not None else None
        for event in reversed(path):
            if root is not None:
                broken[event.event_id] = root
                continue
            if event.prompt_delta is None:
                full[event.event_id] = event
                links[event.event_id] = ChainLink.of(event)
                continue
            parent = links[event.prompt_delta.parent_event_id]
            try:
                resolved, tokens = _resolve_with(event, parent)
            except MissingPromptParent as exc:
                root = broken[event.event_id] = exc.reason
                continue
            full[event.event_id] = resolved
            links[event.event_id] = ChainLink.of(resolved, parent.depth + 1, tokens, event.request.messages,
                                                 keyframe_tokens=parent.keyframe_tokens)

    resolved: list[Completion] = []
    missing: list[MissingParent] = []
    for completion in completions:
        if completion.event_id not in full and completion.event_id not in broken:
            resolve(completion.event_id)
        if completion.event_id in full:
            resolved.append(full[completion.event_id])
            continue
        delta = completion.prompt_delta
        assert delta is not None
        root = broken[completion.event_id]
        direct = _parent_missing_reason(delta, "is not among the session's completions")
        reason = root if root == direct or delta.parent_event_id not in broken else \
            _parent_missing_reason(delta, f"cannot be resolved: {root}")
        missing.append(MissingParent(completion, reason))
    return PromptChain(resolved, missing)


class PromptChains:
    """Resolves the completions of one or more partitions read in order (a parent is always written, and so
    read, before its children), keeping recent events' full prompts in a cache of at most ``max_bytes``
    (least recently used dropped first). A delta whose parent is not in the cache raises
    :class:`MissingPromptParent`: a reader that starts in the middle of a partition, or whose cache is too
    small for the sessions it interleaves, sees that for the rest of a chain (up to the next keyframe:
    at most :data:`KEYFRAME_EVERY` events, unless the chain's keyframes are over the record limit, which
    the proxy then writes as deltas: see ``proxy/capture.py``)."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.resolved = 0
        self.missing = 0
        self._links: OrderedDict[str, ChainLink] = OrderedDict()
        self._broken: OrderedDict[str, str] = OrderedDict()  # event id -> why it could not be resolved

    def __len__(self) -> int:
        return len(self._links)

    def resolve(self, completion: Completion) -> Completion:
        """``completion`` with its full prompt (itself when a keyframe); remembered as a possible parent."""
        delta = completion.prompt_delta
        if delta is None:
            self._remember(ChainLink.of(completion))
            self.resolved += 1
            return completion
        parent = self._links.get(delta.parent_event_id)
        if parent is None:
            root = self._broken.get(delta.parent_event_id)
            if root is not None:
                self._fail(completion.event_id, _parent_missing_reason(delta, f"cannot be resolved: {root}"), root)
            reason = _parent_missing_reason(
                delta, "was not read before it (retention deleted it, it was never written, or it left this "
                f"reader's cache of {self.max_bytes} bytes)")
            self._fail(completion.event_id, reason, reason)
        assert parent is not None
        self._links.move_to_end(parent.event_id)
        try:
            full, tokens = _resolve_with(completion, parent)
        except MissingPromptParent as exc:
            self._fail(completion.event_id, exc.reason, exc.reason)
        self._remember(ChainLink.of(full, parent.depth + 1, tokens, completion.request.messages,
                                    keyframe_tokens=parent.keyframe_tokens))
        self.resolved += 1
        return full

    def remember(self, link: ChainLink) -> None:
        """Take ``link`` as a possible parent (a reader that starts in the middle of a partition and already
        holds the chains' last events: the proxy restoring a session's branches)."""
        self._remember(link)

    def link(self, event_id: str) -> ChainLink | None:
        """The link of an event resolved (or remembered) and still in the cache."""
        return self._links.get(event_id)

    def _fail(self, event_id: str, reason: str, root: str) -> NoReturn:
        """Count and raise; ``root`` (the chain's first break) is what this event's children will be told."""
        self.missing += 1
        self._broken[event_id] = root
        self._broken.move_to_end(event_id)
        while len(self._broken) > 100_000:
            self._broken.popitem(last=False)
        raise MissingPromptParent(reason)

    def _remember(self, link: ChainLink) -> None:
        old = self._links.pop(link.event_id, None)
        if old is not None:
            self.bytes -= old.approx_bytes
        self._links[link.event_id] = link
        self.bytes += link.approx_bytes
        while self.bytes > self.max_bytes and len(self._links) > 1:
            _, dropped = self._links.popitem(last=False)
            self.bytes -= dropped.approx_bytes


# -- writing ----------------------------------------------------------------------------------------------

def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def delta_against(full: Completion, parent: ChainLink, *, keyframe_every: int = KEYFRAME_EVERY,
                  keyframe_growth: float = KEYFRAME_GROWTH) -> Completion:
    """``full`` written as a delta against ``parent`` (its branch's last recorded event), or ``full`` itself
    (a keyframe) when: it is not a served call (a failed call is always a keyframe), it has no prompt ids,
    the parent is of another session, the chain has ``keyframe_every`` events already, the prompt is over
    ``keyframe_growth`` times the chain keyframe's tokens, or the delta would not be smaller than the
    keyframe by :data:`DELTA_OVERHEAD_BYTES`."""
    if full.status != "ok" or full.prompt_token_ids is None or full.prompt_delta is not None \
            or parent.session_id != full.session_id or parent.event_id == full.event_id \
            or parent.depth + 1 >= keyframe_every \
            or len(full.prompt_token_ids) > keyframe_growth * max(1, parent.keyframe_tokens):
        return full
    prompt = full.prompt_token_ids.numpy
    prefix = _common_prefix(parent.tokens, prompt)
    messages = full.request.messages
    shared = 0
    for mine, theirs in zip(messages, parent.messages):
        if mine != theirs:
            break
        shared += 1
    tools = full.request.tools
    inherit = bool(tools) and tools == parent.tools and _TOOLS.dump_json(tools) == _TOOLS.dump_json(parent.tools)
    saved = 4 * prefix + sum(_message_chars(m) for m in messages[:shared]) + \
        (len(_TOOLS.dump_json(tools)) if inherit else 0)
    if saved <= DELTA_OVERHEAD_BYTES:
        return full
    delta = PromptDelta(parent_event_id=parent.event_id, parent_sequence=parent.sequence, prefix_tokens=prefix,
                        messages_prefix=shared, tools_inherited=inherit, prompt_tokens=len(prompt))
    request = full.request.model_copy(update={"messages": list(messages[shared:]),
                                              "tools": [] if inherit else tools})
    return full.model_copy(update={"schema_version": 2, "prompt_token_ids": TokenIds(prompt[prefix:]),
                                   "request": request, "prompt_delta": delta})


def next_link(full: Completion, written: Completion, parent: ChainLink | None) -> ChainLink:
    """The link of a recorded call, the parent of its branch's next one: ``full`` is the call's event whole,
    ``written`` what :func:`delta_against` made of it (against ``parent``)."""
    if parent is not None and is_delta(written):
        return ChainLink.of(full, parent.depth + 1, keyframe_tokens=parent.keyframe_tokens)
    return ChainLink.of(full)


def write_session(completions: Iterable[Completion], *, keyframe_every: int = KEYFRAME_EVERY,
                  keyframe_growth: float = KEYFRAME_GROWTH) -> list[Completion]:
    """A session's full completions (in the order they were recorded) written as the proxy writes them: a
    served call that continues its branch (``continuation.mode`` exact, or no continuation block: events
    from before the proxy built prompts, one chain per session) is a delta against the branch's last
    served event; every other call is a keyframe and, when served, starts its branch's chain anew.
    ``keyframe_every=1`` writes every event whole (as version 1 did)."""
    return list(iter_write_session(completions, keyframe_every=keyframe_every, keyframe_growth=keyframe_growth))


def iter_write_session(completions: Iterable[Completion], *, keyframe_every: int = KEYFRAME_EVERY,
                       keyframe_growth: float = KEYFRAME_GROWTH) -> Iterator[Completion]:
    """:func:`write_session`, one event at a time (for sessions generated on the fly)."""
    ends: dict[str, ChainLink] = {}
    for full in completions:
        continuation = full.continuation
        branch = continuation.branch if continuation is not None else "-"
        continues = continuation is None or continuation.mode == "exact"
        parent = ends.get(branch) if continues else None
        written = full if parent is None else \
            delta_against(full, parent, keyframe_every=keyframe_every, keyframe_growth=keyframe_growth)
        yield written
        if full.status == "ok" and full.prompt_token_ids is not None:
            ends[branch] = next_link(full, written, parent)
