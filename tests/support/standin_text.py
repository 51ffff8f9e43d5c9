"""The stand-in engine's text and token model, shared by its chat and token endpoints.

The pieces that both ``tests/support/standin_engine.py`` (``/v1/chat/completions``, ``/tokenize``) and
``tests/support/standin_tokens.py`` (render, generate, derender, detokenize) build their replies from, with no
server state: the recorded vLLM responses (``tests/fixtures/vllm/``) the replies are shaped on, the
ChatML-like prompt rendering, the tokenizer (one id per UTF-8 byte, or per group of bytes), the reply
text for a request (forced text or ids, a literal regex, or seeded words), the float32 logprobs, and the
tool calls read back from a reply's text.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import uuid
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm"
FORCED_TOKENS_ARG = "rollwire_forced_tokens"  # deploy/engine/plugins: the real engine's forced ids
FORCED_TEXT_ARG = "rollwire_forced_text"  # the same turn's text, what the stand-in replies
_WORDS = ("the", "file", "test", "def", "return", "import", "fix", "value", "error", "path", "self", "run")


def load_fixture(name: str) -> dict[str, Any]:
    """A recorded vLLM exchange from ``tests/fixtures/vllm/``."""
    return json.loads((FIXTURES / name).read_text())


def render_prompt(body: dict[str, Any]) -> str:
    """A ChatML-like rendering; only its determinism and prefix property matter here."""
    parts = []
    if body.get("tools"):
        parts.append("<|im_start|>system\n# Tools\n" + json.dumps(body["tools"], sort_keys=True) + "<|im_end|>\n")
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        text = content or ""
        if message.get("reasoning"):
            text = f"<think>{message['reasoning']}</think>" + text
        for i, call in enumerate(message.get("tool_calls") or ()):
            # Laid out as the real template writes a call (deploy/engine/chat_template.jinja). vLLM parses the
            # arguments the harness echoes and the template re-serializes them (json.dumps, default
            # separators), so a model that sampled that layout sees its own text again in the next prompt.
            function = call.get("function") or {}
            arguments = function.get("arguments")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                arguments = {}
            arguments = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
            text += ("\n" if i or text else "") + '<tool_call>\n{"name": "' + str(function.get("name")) + \
                '", "arguments": ' + arguments + '}\n</tool_call>'
        parts.append(f"<|im_start|>{message.get('role')}\n{text}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def tokenize(text: str, bytes_per_token: int = 1) -> list[int]:
    """One id per UTF-8 byte (tests); with ``bytes_per_token`` > 1, one id per group of bytes, for
    benchmarks that want a realistic number of tokens per request."""
    data = text.encode("utf-8")
    if bytes_per_token == 1:
        return list(data)
    padded = data + b"\0" * (-len(data) % bytes_per_token)
    groups = np.frombuffer(padded, dtype=np.uint8).reshape(-1, bytes_per_token).astype(np.uint64)
    weights = np.array([256 ** i for i in range(bytes_per_token)], dtype=np.uint64)
    return ((groups * weights).sum(axis=1) % 151_643).tolist()


def _regex_literal(pattern: str) -> str | None:
    """The text a regex made of escaped literals matches, or None if it is not such a regex."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            out.append({"n": "\n", "t": "\t"}.get(nxt, nxt))
            i += 2
            continue
        if ch in ".*+?[]()|^$":
            return None
        out.append(ch)
        i += 1
    return "".join(out)


def forced_xargs(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """A turn forced for the real engine: its text and its ids (``vllm_xargs``), each None if absent."""
    xargs = body.get("vllm_xargs") or {}
    text, ids = xargs.get(FORCED_TEXT_ARG), xargs.get(FORCED_TOKENS_ARG)
    if isinstance(ids, str):
        parts = [part.strip() for part in ids.split(",")]
        ids = [int(part) for part in parts if part] if all(p.isdigit() for p in parts if p) else None
    return (text if isinstance(text, str) else None), (list(ids) if isinstance(ids, list) else None)


def reply_text(body: dict[str, Any], prompt_ids: list[int], n_tokens: int) -> str:
    """The reply to a chat-like body: its forced text or ids, a literal ``structured_outputs.regex``, or
    words seeded by the prompt's last ids and the request's seed."""
    forced_text, forced_ids = forced_xargs(body)
    if forced_text is not None:
        return forced_text
    if forced_ids is not None:
        return bytes(i for i in forced_ids if 0 <= i < 256).decode("utf-8", errors="ignore")
    forced = (body.get("structured_outputs") or {}).get("regex")
    if forced:
        literal = _regex_literal(forced)
        if literal is not None:
            return literal
    key = json.dumps([prompt_ids[-256:], body.get("seed")]).encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "big")
    words = [_WORDS[(seed >> (i % 24) ^ i * 7) % len(_WORDS)] for i in range(max(1, n_tokens // 2))]
    return " ".join(words)


def top_alternatives(token: int, position: int, k: int) -> list[int]:
    """The ``k`` ids a ``top_logprobs: k`` entry lists, as vLLM 0.32 lists them: the sampled ``token``
    first, then the likeliest others (here its byte neighbours: a stand-in has no distribution)."""
    if k <= 0:
        return []
    others = sorted(((token + d) % 256 for d in range(1, k)), key=lambda t: -logprob(t, position))
    return [token, *others]


def logprob(token: int, position: int) -> float:
    """A deterministic logprob for a token at a position, rounded to float32 as vLLM computes them."""
    raw = -((token * 2654435761 + position * 40503) % 10_000) / 2500.0
    return struct.unpack("f", struct.pack("f", raw))[0]  # float32, as vLLM computes them


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def tool_calls(text: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``<tool_call>{json}</tool_call>`` blocks of a reply as OpenAI tool calls, when the request offered
    tools (and did not say ``tool_choice: none``)."""
    if not body.get("tools") or body.get("tool_choice") == "none":
        return []
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        calls.append({"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function",
                      "function": {"name": call.get("name", ""),
                                   "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}})
    return calls
