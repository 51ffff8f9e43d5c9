"""Message equivalence: when a harness's history "is" the history the proxy served, so a call continues a branch.

Harnesses send the conversation back changed in ways that do not change what was said. The proxy decides
equivalence on the normalized form (``schemas.completions.ChatMessage``, the same for all four provider
APIs), message by message:

- **role**: equal, with ``developer`` taken as ``system``.
- **text**: the text of the content (a string, or the text parts joined with a newline, as the chat
  template joins them), compared after stripping leading and trailing whitespace. Images make a message
  comparable only to an identical one (a harness that strips images from history changes the history).
- **assistant turns** (the turns the proxy served, compared against what it returned):
  - reasoning is ignored: harnesses drop it, echo it, or echo it trimmed; the branch's tokens hold what
    was sampled, so what the harness sends back cannot change the prompt. Reasoning is the ``reasoning``
    field, or a leading ``<think>…</think>`` block of the text when the engine runs without a reasoning
    parser (:func:`split_reasoning`);
  - tool calls: the same number, in order, with the same names; arguments equal as JSON values when both
    parse (``{"a":1}`` and ``{"a": 1}`` are the same call), else equal as stripped text; call ids are
    ignored (harnesses rename them);
  - content: equal, or empty in the harness's copy when the turn made tool calls (some harnesses drop
    the text that came with tool calls).
- **tool results**: equal text; ``tool_call_id`` ignored (it follows the harness's own call ids).
- ``name``, cache-control marks and other provider metadata never reach the normalized form and play
  no part.

Anything else (a changed system prompt, an edited or summarized earlier turn, a different tool list) is
a different history: the call opens a new branch, rendered whole.
"""

from __future__ import annotations

from typing import Any

import orjson

from schemas.completions import ChatMessage, ToolCall, ToolDefinition


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def content_text(message: ChatMessage) -> str | None:
    """The message's text as the template sees it; None when it holds anything but text."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text":
            return None
        texts.append(part.text or "")
    return "\n".join(texts)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """A leading ``<think>…</think>`` block of an assistant text and the rest (None, text when none)."""
    stripped = text.lstrip()
    if not stripped.startswith("<think>"):
        return None, text
    end = stripped.find("</think>")
    if end < 0:
        return None, text
    return stripped[len("<think>"):end].strip(), stripped[end + len("</think>"):]


def _json_value(text: str) -> tuple[bool, Any]:
    try:
        return True, orjson.loads(text)
    except orjson.JSONDecodeError:
        return False, None


def same_arguments(sampled: str, echoed: str) -> bool:
    """Whether two tool-call argument texts carry the same call (JSON-equal, else equal text)."""
    if sampled.strip() == echoed.strip():
        return True
    parsed_a, a = _json_value(sampled)
    parsed_b, b = _json_value(echoed)
    return parsed_a and parsed_b and a == b


def _same_calls(served: list[ToolCall], echoed: list[ToolCall]) -> bool:
    return len(served) == len(echoed) and all(
        a.name == b.name and same_arguments(a.arguments, b.arguments) for a, b in zip(served, echoed))


def same_message(served: ChatMessage, echoed: ChatMessage) -> bool:
    """Whether ``echoed`` (from the harness) stands for ``served`` (what the proxy knows was said)."""
    if _role(served) != _role(echoed):
        return False
    if served.role == "assistant":
        if not _same_calls(served.tool_calls, echoed.tool_calls):
            return False
        text_a, text_b = content_text(served), content_text(echoed)
        if text_a is None or text_b is None:
            return served.content == echoed.content
        text_a, text_b = split_reasoning(text_a)[1], split_reasoning(text_b)[1]
        return text_a.strip() == text_b.strip() or (bool(served.tool_calls) and not text_b.strip())
    text_a, text_b = content_text(served), content_text(echoed)
    if text_a is None or text_b is None:
        return served.content == echoed.content
    return text_a.strip() == text_b.strip()


def common_prefix(served: list[ChatMessage], echoed: list[ChatMessage]) -> int:
    """How many leading messages of ``echoed`` stand for the same leading messages of ``served``."""
    count = 0
    for a, b in zip(served, echoed):
        if not same_message(a, b):
            break
        count += 1
    return count


def tools_signature(tools: list[ToolDefinition]) -> bytes:
    """A canonical form of the tool list: a branch continues only under the same tools (they are rendered
    into the prompt's first turn)."""
    return orjson.dumps([t.model_dump(mode="json") for t in tools], option=orjson.OPT_SORT_KEYS)
