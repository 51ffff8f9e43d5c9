"""One rubric judgement: the prompt, the calls to an OpenAI-compatible judge, and the parsed answer.

The prompt holds the task's instruction, the rubric, the session's final answer (the end of what the
harness printed) and its patch (the start), each bounded and the cut marked where one was made. The
request asks for :class:`~schemas.judge.JudgeAnswer` through structured outputs (``response_format``
``json_schema``, strict), at temperature 0. A call that fails (connection, timeout, HTTP error) or whose
answer is not exactly that shape with a score within the scale is retried, up to ``max_attempts`` calls in
all; :class:`JudgeFailed` then carries the record of every attempt. Nothing is guessed from a bad answer.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from processors.evaluators.base import EvaluatorError
from schemas.judge import JudgeAnswer, JudgeAttempt, Judgement, answer_schema

CUT_MARK = "[… {n} characters cut …]"
SYSTEM_PROMPT = ("You grade an AI coding agent's work on a task by a rubric. Read the task, the rubric, the "
                 "agent's final answer and its changes, then score the work from 0 to {scale} by the rubric. "
                 'Answer with JSON only: {{"score": <number from 0 to {scale}>, "reason": "<one or two sentences>"}}.')


class JudgeFailed(EvaluatorError):
    """No attempt gave a usable judgement; ``judgement`` records every attempt."""

    def __init__(self, message: str, judgement: Judgement) -> None:
        super().__init__(message)
        self.judgement = judgement


@dataclass(frozen=True, slots=True)
class JudgeRequest:
    """Everything one judgement needs."""

    url: str
    model: str
    rubric: str
    instruction: str
    answer: str
    patch: str
    scale: float
    coefficient: float
    api_key: str | None = None
    timeout_s: float = 60.0
    max_attempts: int = 3
    max_tokens: int = 256
    answer_chars: int = 4000
    patch_chars: int = 12000
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Request fields merged over the body (a field set to None is removed), e.g. vLLM's structured_outputs."""


def bounded(text: str, limit: int, *, keep: str) -> tuple[str, bool]:
    """``text`` cut to about ``limit`` characters, keeping its ``start`` or ``end``, the cut marked."""
    if len(text) <= limit:
        return text, False
    mark = CUT_MARK.format(n=len(text) - limit)
    return (text[:limit] + "\n" + mark, True) if keep == "start" else (mark + "\n" + text[-limit:], True)


def messages_for(request: JudgeRequest) -> tuple[list[dict[str, str]], list[str]]:
    """The chat messages, and which parts were cut."""
    answer, answer_cut = bounded(request.answer.strip() or "(the agent printed nothing)", request.answer_chars,
                                 keep="end")
    patch, patch_cut = bounded(request.patch.strip() or "(the agent changed no file)", request.patch_chars,
                               keep="start")
    user = (f"## Task\n{request.instruction.strip()}\n\n## Rubric\n{request.rubric.strip()}\n\n"
            f"## The agent's final answer\n{answer}\n\n## The agent's changes (git diff)\n{patch}\n")
    system = SYSTEM_PROMPT.format(scale=f"{request.scale:g}")
    truncated = [name for name, cut in (("answer", answer_cut), ("patch", patch_cut)) if cut]
    return [{"role": "system", "content": system}, {"role": "user", "content": user}], truncated


def body_for(request: JudgeRequest, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The chat completions request body."""
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "temperature": 0, "max_tokens": request.max_tokens,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "judgement", "strict": True, "schema": answer_schema(request.scale)}}}
    body.update(request.extra_body)
    return {k: v for k, v in body.items() if v is not None}


def parse_answer(raw: str, scale: float) -> JudgeAnswer:
    """The answer as a JudgeAnswer with a score within [0, scale]; ValueError says why not."""
    try:
        answer = JudgeAnswer.model_validate_json(raw.strip())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(answer)"
        raise ValueError(f"not the structured form: {where}: {first['msg']}") from None
    if not 0 <= answer.score <= scale:
        raise ValueError(f"score {answer.score:g} is outside 0..{scale:g}")
    return answer


def _content(response: httpx.Response) -> str:
    document = response.json()
    content = document["choices"][0]["message"].get("content")
    if not isinstance(content, str):
        raise ValueError("the answer has no text content")
    return content


async def judge(request: JudgeRequest, client: httpx.AsyncClient | None = None) -> tuple[JudgeAnswer, Judgement]:
    """Judge once (with retries); the answer and its record, or :class:`JudgeFailed`."""
    messages, truncated = messages_for(request)
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
    record = Judgement(url=request.url, model=request.model, prompt_sha256=digest,
                       prompt_chars=sum(len(m["content"]) for m in messages), truncated=truncated,
                       scale=request.scale, coefficient=request.coefficient, seconds=0.0)
    headers = {"Authorization": f"Bearer {request.api_key}"} if request.api_key else {}
    started = time.monotonic()
    owned = client is None
    http = client or httpx.AsyncClient(timeout=request.timeout_s)
    try:
        for _ in range(request.max_attempts):
            began = time.monotonic()
            raw: str | None = None
            try:
                response = await http.post(f"{request.url.rstrip('/')}/v1/chat/completions", headers=headers,
                                           json=body_for(request, messages), timeout=request.timeout_s)
                if response.status_code != 200:
                    raise ValueError(f"HTTP {response.status_code}: {response.text[:300]}")
                raw = _content(response)
                answer = parse_answer(raw, request.scale)
            except httpx.TimeoutException:
                error = f"no answer within {request.timeout_s:g} s"
            except httpx.HTTPError as exc:
                error = f"{request.url} unreachable: {type(exc).__name__}: {exc}"
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                error = str(exc) or type(exc).__name__
            else:
                record.attempts.append(JudgeAttempt(raw=raw, seconds=round(time.monotonic() - began, 3)))
                record.raw, record.score, record.reason = raw, answer.score, answer.reason
                record.seconds = round(time.monotonic() - started, 3)
                return answer, record
            record.attempts.append(JudgeAttempt(raw=raw, error=error[:1000], seconds=round(time.monotonic() - began, 3)))
    finally:
        if owned:
            await http.aclose()
    record.raw = record.attempts[-1].raw if record.attempts else None
    record.seconds = round(time.monotonic() - started, 3)
    last = record.attempts[-1].error if record.attempts else "no attempt"
    raise JudgeFailed(f"the judge gave no usable answer in {len(record.attempts)} calls: {last}", record)
