"""Building a continued call's exact prompt from its branch's tokens, and measuring what a re-render would change.

A call placed ``continue`` (:mod:`proxy.continuation.branches`) is sent to the engine as

    branch tokens (the parent's prompt + sampled ids) [+ close] + glue + Y

- **Y**, the new messages' tokens and the generation prompt, comes from the model's own chat template
  through the engine's render endpoint, never from decoding sampled text: render a short stand-in history
  that ends with an assistant turn (carrying the parent turn's tool calls, so templates that lay out tool
  results after tool calls see the same shape) with and without the new messages; Y is what the longer
  render adds. If the shorter render is not a prefix of the longer one the template is not append-only
  for these messages, and the call falls back to a full render (``opened: render_not_prefix``).
- **close** and **glue** (:class:`TurnFrame`): the token that ends an assistant turn and what the
  template writes after it (ChatML: ``<|im_end|>`` and ``\\n``). Learned once per template settings by
  rendering a one-word assistant turn. A turn that ended on one of the engine's end ids
  (:func:`proxy.engine.ends_on_end_id`: the tokenizer's end of sequence, the close here; the generation
  config's others, such as ``<|endoftext|>``; the request's ``stop_token_ids``) is closed by that sampled
  id, and only the glue follows; a turn cut by the token limit (or stopped by a stop string) gets the
  close token added, and the event says so (``closed_cut_turn``): the trainer must not train on it (it
  was never sampled). docs/token-fidelity-end-ids.md says which is which.

Drift (:meth:`Continuations.drift`): the full re-render of the same history is compared with the exact
prompt; when they differ the kinds are told apart by text (:class:`schemas.completions.Drift`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.continuation.branches import Branch, Placement
from proxy.engine import engine_message
from proxy.continuation.equivalence import content_text, split_reasoning
from proxy.continuation.token_api import TokenApi
from schemas.completions import ChatMessage, Drift, DriftKind, NormalizedRequest

logger = logging.getLogger(__name__)

_WORD = "d"  # the stand-in histories' text: one short word, one token in any vocabulary worth the name


class CannotContinue(Exception):
    """The call cannot be continued exactly; it is rendered whole (the reason goes on the event)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TurnFrame:
    """How the template ends an assistant turn: ``close`` (sampled by the model when it stops) + ``glue``."""

    close: tuple[int, ...]
    glue: tuple[int, ...]


@dataclass
class ExactPrompt:
    token_ids: list[int]
    prefix_tokens: int
    new_tokens: int
    closed_cut_turn: bool


def _find_last(haystack: list[int], needle: list[int]) -> int:
    """Index of the last occurrence of ``needle`` in ``haystack``, or -1."""
    n = len(needle)
    for start in range(len(haystack) - n, -1, -1):
        if haystack[start:start + n] == needle:
            return start
    return -1


class Continuations:
    """Exact prompts and drift measurements for one engine (its template frames cached)."""

    def __init__(self, tokens: TokenApi) -> None:
        self.tokens = tokens
        self._frames: dict[bytes, TurnFrame] = {}

    def _render_body(self, model: str, messages: list[dict[str, Any]], generation_prompt: bool,
                     template_kwargs: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": messages, "add_generation_prompt": generation_prompt}
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return body

    async def frame(self, model: str, template_kwargs: dict[str, Any]) -> TurnFrame:
        """The template's turn frame: render one user turn with the generation prompt, and the same with a
        one-word assistant turn; the assistant turn's ids after the word are close + glue."""
        key = orjson.dumps(template_kwargs, option=orjson.OPT_SORT_KEYS)
        if key in self._frames:
            return self._frames[key]
        user = {"role": "user", "content": _WORD}
        opened = await self.tokens.render_ids(self._render_body(model, [user], True, template_kwargs))
        closed = await self.tokens.render_ids(self._render_body(
            model, [user, {"role": "assistant", "content": _WORD}], False, template_kwargs))
        word = await self.tokens.tokenize(_WORD, model)
        if closed[:len(opened)] != opened:
            raise CannotContinue("template_not_append_only")
        tail = closed[len(opened):]
        at = _find_last(tail, word)
        rest = tail[at + len(word):] if at >= 0 else []
        if not rest:
            raise CannotContinue("template_close_unknown")
        frame = TurnFrame(close=(rest[0],), glue=tuple(rest[1:]))
        self._frames[key] = frame
        logger.info("template frame for %s: close=%s glue=%s", template_kwargs or "defaults", frame.close, frame.glue)
        return frame

    async def extend(self, placement: Placement, request: NormalizedRequest, model: str) -> ExactPrompt:
        """The exact prompt for a ``continue`` placement; CannotContinue when the template does not allow it."""
        branch = placement.branch
        assert branch is not None and placement.kind == "continue"
        kwargs = request.chat_template_kwargs
        frame = await self.frame(model, kwargs)
        parent_turn = branch.history[-1]
        dummy = [{"role": "user", "content": _WORD},
                 engine_message(ChatMessage(role="assistant", content=_WORD, tool_calls=parent_turn.tool_calls))]
        new = [engine_message(m) for m in placement.new_messages]
        shorter = await self.tokens.render_ids(self._render_body(model, dummy, False, kwargs))
        longer = await self.tokens.render_ids(self._render_body(model, dummy + new, True, kwargs))
        if longer[:len(shorter)] != shorter:
            raise CannotContinue("render_not_prefix")
        new_ids = longer[len(shorter):]
        close_at = _find_last(shorter, list(frame.close))
        glue = shorter[close_at + len(frame.close):] if close_at >= 0 else list(frame.glue)
        tokens = branch.tokens
        # A turn that ended on a sampled end id is closed by it (<|im_end|>, <|endoftext|>, a request's
        # stop token id); a turn cut by the limit or a stop string gets the template's close.
        ends_closed = branch.closed
        closing = [] if ends_closed else list(frame.close)
        prompt = tokens.tolist()
        prompt += [*closing, *glue, *new_ids]
        return ExactPrompt(token_ids=prompt, prefix_tokens=len(tokens), new_tokens=len(prompt) - len(tokens),
                           closed_cut_turn=not ends_closed)

    async def drift(self, branch: Branch, exact: list[int], rendered: list[int], request: NormalizedRequest,
                    model: str) -> Drift:
        """How the full re-render ``rendered`` differs from the ``exact`` prompt, and why."""
        if exact == rendered:
            return Drift(differs=False, rendered_prompt_tokens=len(rendered))
        first = next((i for i, (a, b) in enumerate(zip(exact, rendered)) if a != b), min(len(exact), len(rendered)))
        kinds: list[DriftKind] = []
        try:
            exact_text = await self.tokens.detokenize(exact, model)
            rendered_text = await self.tokens.detokenize(rendered, model)
            if exact_text == rendered_text:
                kinds.append("retokenized_text")
            else:
                kinds.extend(await self._text_kinds(branch, rendered_text, request, model))
        except Exception as exc:  # a measurement must never fail the call
            logger.warning("drift not classified: %r", exc)
            kinds.append("other")
        return Drift(differs=True, kinds=kinds, first_divergence=first, rendered_prompt_tokens=len(rendered))

    async def _text_kinds(self, branch: Branch, rendered_text: str, request: NormalizedRequest,
                          model: str) -> list[DriftKind]:
        echoed = [m for m in request.messages if m.role == "assistant"][-len(branch.spans):] if branch.spans else []
        kinds: set[DriftKind] = set()
        unexplained = False
        for span, served, echo in zip(branch.spans, branch.served, echoed):
            if span.text is None:
                span.text = await self.tokens.detokenize(branch.tokens[span.start:span.end].tolist(), model)
            if _strip_close(span.text) in rendered_text:
                continue
            found = False
            reasoning = served.reasoning or split_reasoning(content_text(served) or "")[0]
            if reasoning and reasoning.strip() and reasoning.strip() not in rendered_text:
                kinds.add("reasoning_stripped")
                found = True
            if any(call.arguments not in span.text for call in echo.tool_calls):
                kinds.add("tool_arguments_reserialized")
                found = True
            unexplained = unexplained or not found
        if unexplained:
            kinds.add("retokenized_text" if _same_words(branch, rendered_text) else "other")
        if not kinds:
            kinds.add("template")  # every sampled span is there as sampled: the glue around them differs
        return sorted(kinds)


def _strip_close(text: str) -> str:
    return text.rsplit("<|", 1)[0] if text.endswith("|>") else text


def _same_words(branch: Branch, rendered_text: str) -> bool:
    return all((content_text(m) or "").strip() in rendered_text for m in branch.served if not m.tool_calls)
