"""A session's branches: the exact token sequences the engine saw and sampled, and the history they stand for.

Each branch holds the tokens of its last call (prompt + sampled ids) and the message history those tokens
stand for (that call's messages + the assistant turn the proxy returned). :meth:`BranchStore.place`
decides where a new call goes:

- **continue**: its messages extend a branch's history (by :mod:`proxy.continuation.equivalence`) with only
  non-assistant messages (tool results, a user message): the prompt will be the branch's tokens + the
  tokens of the new messages;
- **retry**: its messages are the branch's last call's messages again (an SDK retry, a harness that asks
  again): the prompt is that call's prompt again, and the abandoned sample is named on the event;
- **open**: anything else opens a new branch, rendered whole. A call that asks for structured output
  (a router, a title, a memory extraction) only ever extends a branch of such calls: it never continues
  or retries the agent's own line, even when it sends the same history. A call that shares only part of a branch
  (it rewinds to an earlier turn: a fork) opens a new branch too, so two branches never share a sampled
  token.

Roles (decided when a branch opens, from the call's own signals): ``side`` for a call that asks for
structured output, or offers no tools while the session's main branch does (titles, summaries, router
and memory calls); ``sub_agent`` for a call with tools whose system prompt differs from the main branch's;
``main`` otherwise (the first branch, compactions of the main line).

A branch's tokens are kept packed (a read-only int32 array, 4 bytes an id: the very array its recorded
event's link holds, when there is one): a Python list of a long prompt's ids is tens of thousands of
objects that every full collection of the cyclic GC walks; its last prompt is the first
``prompt_length`` of them, not a copy.

A branch is named after the call that opened it (``b<sequence>``): call numbers are unique within a session
whichever proxy process gave them (:mod:`proxy.tier.claims`), so two processes opening branches of one
session at once never give two branches one name.

The store is per session and per proxy process, and bounded: at most :data:`MAX_BRANCHES` branches, the
least recently used dropped first. It is a view of the log: the calls of the session that another process
served (or this one before it was started again) are replayed into it from their events
(:meth:`BranchStore.replay`, driven by :mod:`proxy.continuation.restore`) before the session's next call is
placed, so a session continues exactly whichever process serves it.

Each branch also remembers its last recorded event (:attr:`Branch.link`, a
:class:`schemas.prompt_chain.ChainLink`: event id, prompt + sampled ids, messages, tools, chain depth):
the parent the next exactly continued call's event is written as a delta against. It is set only once the
broker has acknowledged that event, so a delta never names an event that is not on the log; a branch
evicted is simply gone, and the next call opens a branch whose event is a keyframe, so eviction never
leaves a dangling reference.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from proxy.continuation.equivalence import common_prefix, content_text, same_message, tools_signature
from proxy.turns import ends_on_end_id
from schemas.completions import BranchRole, ChatMessage, Completion, NormalizedRequest, ToolDefinition
from schemas.arrays import TokenIds
from schemas.prompt_chain import ChainLink

MAX_BRANCHES = 64

# Engine extras a harness uses to ask for structured output (a side call's signal).
_STRUCTURED_KEYS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                    "guided_grammar")


@dataclass
class SampledSpan:
    """One assistant turn's sampled ids within a branch's tokens: ``tokens[start:end]``."""

    start: int
    end: int
    sequence: int
    text: str | None = None  # detokenized lazily, when drift is measured


@dataclass
class Branch:
    """One chain of calls whose prompts extend each other token for token."""

    branch_id: str
    role: BranchRole
    tools: bytes
    system_text: str | None
    history: list[ChatMessage]
    tokens: np.ndarray  # the last call's prompt + sampled ids, packed (int32, read-only)
    last_sequence: int
    last_request: list[ChatMessage]
    prompt_length: int  # the last call's prompt: tokens[:prompt_length]
    finish_reason: str | None
    structured: bool = False  # its calls ask for structured output (side calls)
    closed: bool = False  # the last turn ended with a sampled end-of-turn token
    last_parent: int | None = None
    spans: list[SampledSpan] = field(default_factory=list)
    served: list[ChatMessage] = field(default_factory=list)  # assistant turns as served, in order
    link: ChainLink | None = None  # the last recorded event: the next delta's parent
    engine: str | None = None  # the engine that served its last call: where its prefix is cached

    @property
    def last_prompt(self) -> list[int]:
        """The last call's prompt ids."""
        return self.tokens[:self.prompt_length].tolist()


@dataclass
class Placement:
    """Where a call goes: which branch, and how its prompt is built."""

    kind: Literal["continue", "retry", "open"]
    branch: Branch | None
    new_messages: list[ChatMessage]
    opened: str | None = None
    role: BranchRole = "main"


def _system_text(request: NormalizedRequest) -> str | None:
    first = request.messages[0] if request.messages else None
    if first is None or first.role not in ("system", "developer"):
        return None
    return content_text(first)


def _structured(request: NormalizedRequest) -> bool:
    return any(key in request.sampling.extra for key in _STRUCTURED_KEYS)


class BranchStore:
    """The branches of one session."""

    def __init__(self) -> None:
        self._branches: OrderedDict[str, Branch] = OrderedDict()
        # The last tool list signed, and its signature: a session sends the same tools on every call, and
        # comparing them is far cheaper than dumping and sorting them again.
        self._signed: tuple[list[ToolDefinition], bytes] | None = None

    def _tools_signature(self, tools: list[ToolDefinition]) -> bytes:
        signed = self._signed
        if signed is not None and signed[0] == tools:
            return signed[1]
        signature = tools_signature(tools)
        self._signed = (list(tools), signature)
        return signature

    def __len__(self) -> int:
        return len(self._branches)

    def links(self) -> list[ChainLink]:
        """The last recorded event of every branch that has one (the parents its next deltas may name)."""
        return [branch.link for branch in self._branches.values() if branch.link is not None]

    @property
    def main(self) -> Branch | None:
        """The agent's line: the first ``main`` branch that offers tools, else the first ``main`` branch."""
        mains = [b for b in self._branches.values() if b.role == "main"]
        return next((b for b in mains if b.tools != _NO_TOOLS), mains[0] if mains else None)

    def place(self, request: NormalizedRequest, harness_request: NormalizedRequest | None = None) -> Placement:
        """Decide where ``request`` goes (``harness_request``: as the harness sent it, before the session's
        overrides, for the role signals)."""
        signature = self._tools_signature(request.tools)
        messages = request.messages
        structured = _structured(harness_request or request)
        best: Placement | None = None
        reason = "first_call" if not self._branches else "history_differs"
        for branch in reversed(self._branches.values()):  # most recently used first
            if branch.structured != structured:
                continue  # a structured side call (a router, a title) never extends the agent's line
            if branch.tools != signature:
                if common_prefix(branch.history, messages) == len(branch.history):
                    reason = "tools_differ"
                continue
            if len(messages) == len(branch.last_request) and \
                    all(same_message(a, b) for a, b in zip(branch.last_request, messages)):
                best = Placement("retry", branch, [])
                break
            shared = common_prefix(branch.history, messages)
            if shared == len(branch.history) and len(messages) > shared:
                tail = messages[shared:]
                if any(m.role == "assistant" for m in tail):
                    reason = "assistant_in_new_messages"
                    continue
                best = Placement("continue", branch, list(tail))
                break
            if shared > 0 and reason == "history_differs":
                reason = "fork" if shared >= _first_turn(branch.history) else "history_differs"
        if best is not None:
            return best
        return Placement("open", None, list(messages), opened=reason,
                         role=self._role_for(request, harness_request or request))

    def _role_for(self, request: NormalizedRequest, harness_request: NormalizedRequest) -> BranchRole:
        main = self.main
        if _structured(harness_request):
            return "side"
        if main is None:
            return "main"
        if request.tools and main.tools == _NO_TOOLS:
            # The session's first call offered no tools and the agent's own first call came after it (opencode
            # asks for the session's title first): the first call with tools opens the agent's line.
            return "main"
        if not request.tools and main.tools != _NO_TOOLS:
            return "side"
        if request.tools and _system_text(request) != main.system_text:
            return "sub_agent"
        return "main"

    def open(self, placement: Placement, request: NormalizedRequest, sequence: int,
             harness_request: NormalizedRequest | None = None) -> Branch:
        """A new branch for a call placed ``open`` (its tokens are filled in by :meth:`record`)."""
        branch = Branch(branch_id=branch_id_for(sequence), role=placement.role,
                        tools=self._tools_signature(request.tools), system_text=_system_text(request),
                        history=list(request.messages), tokens=_NO_TOKENS, last_sequence=sequence,
                        last_request=list(request.messages), prompt_length=0, finish_reason=None,
                        structured=_structured(harness_request or request))
        self._branches[branch.branch_id] = branch
        self._evict()
        return branch

    def record(self, branch: Branch, request: NormalizedRequest, sequence: int, prompt: Sequence[int],
               sampled: Sequence[int], served: ChatMessage, finish_reason: str | None, *, closed: bool,
               retry: bool, link: ChainLink | None = None) -> None:
        """The call's turn is done: the branch now stands for its messages + the served assistant turn
        (``link``: the call's recorded event, the parent of the branch's next delta)."""
        if retry and branch.spans and branch.spans[-1].sequence == branch.last_sequence:
            branch.spans.pop()
            branch.served.pop()
        branch.history = [*request.messages, served]
        branch.last_request = list(request.messages)
        branch.prompt_length = len(prompt)
        branch.tokens = _packed(prompt, sampled, link)
        branch.spans = [s for s in branch.spans if s.end <= len(prompt)]
        branch.spans.append(SampledSpan(len(prompt), len(prompt) + len(sampled), sequence))
        branch.served.append(served)
        branch.last_sequence = sequence
        branch.finish_reason = finish_reason
        branch.closed = closed and bool(sampled)
        branch.link = link
        # Most recently used last; a branch evicted while its call was in flight (the session opened
        # MAX_BRANCHES others meanwhile) comes back, since its call was the latest to end.
        self._branches[branch.branch_id] = branch
        self._branches.move_to_end(branch.branch_id)
        self._evict()

    def replay(self, event: Completion, link: ChainLink | None = None) -> bool:
        """Take a call that another process served (its event resolved to its full prompt, events replayed in
        log order) as this store would have taken it had it served the call: its branch opened, continued or
        retried, its turn the branch's new end (``link``: the event's chain link, for the next delta). False
        for an event that tells nothing of branches (a failed call, no continuation block) or is older than
        its branch's end (a call that ran beside a later one of its branch)."""
        continuation = event.continuation
        if (event.status != "ok" or continuation is None or event.prompt_token_ids is None
                or event.token_ids is None or event.message is None):
            return False
        request = event.request
        branch = self._branches.get(continuation.branch)
        retry = continuation.retry_of_sequence is not None
        if branch is None:
            branch = Branch(branch_id=continuation.branch, role=continuation.role,
                            tools=self._tools_signature(request.tools), system_text=_system_text(request),
                            history=list(request.messages), tokens=_NO_TOKENS, last_sequence=event.sequence,
                            last_request=list(request.messages), prompt_length=0, finish_reason=None,
                            structured=_structured(request))
            self._branches[branch.branch_id] = branch
        elif event.sequence < branch.last_sequence:
            return False
        elif not retry:
            branch.last_parent = branch.last_sequence
        message = event.message
        served = ChatMessage(role="assistant", content=message.content, reasoning=message.reasoning,
                             tool_calls=message.tool_calls)
        sampled = event.token_ids.numpy.tolist()
        self.record(branch, request, event.sequence, event.prompt_token_ids.numpy.tolist(), sampled, served,
                    event.finish_reason, closed=ends_on_end_id(event.finish_reason, event.stop_reason, sampled),
                    retry=retry, link=link if link is not None else ChainLink.of(event))
        branch.engine = event.engine
        return True

    def _evict(self) -> None:
        while len(self._branches) > MAX_BRANCHES:
            self._branches.popitem(last=False)


_NO_TOKENS = np.zeros(0, dtype=np.int32)
_NO_TOKENS.flags.writeable = False
_NO_TOOLS = tools_signature([])  # the signature of a call that offers no tools


def _packed(prompt: Sequence[int], sampled: Sequence[int], link: ChainLink | None) -> np.ndarray:
    """Prompt + sampled ids as one read-only int32 array: the recorded event's own (``link.tokens``, built
    from this turn's packed ids) when there is one, else packed here (the engine's ids are int32: the
    event's TokenIds refuses any other before a turn is remembered)."""
    if link is not None and len(link.tokens) == len(prompt) + len(sampled):
        return link.tokens
    head = prompt.numpy if isinstance(prompt, TokenIds) else np.asarray(prompt, dtype=np.int32)
    tokens = np.concatenate([head, np.asarray(sampled, dtype=np.int32)])
    tokens.flags.writeable = False
    return tokens


def branch_id_for(sequence: int) -> str:
    """The name of the branch that the call numbered ``sequence`` opens."""
    return f"b{sequence}"


def _first_turn(history: list[ChatMessage]) -> int:
    """Index just past the first assistant turn (a history sharing less than that shares no sample)."""
    for i, message in enumerate(history):
        if message.role == "assistant":
            return i + 1
    return len(history) + 1
