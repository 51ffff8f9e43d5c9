"""Generated sessions for the prompt-delta tests: the full events of a session driven by a list of steps
(continue, open a branch, retry, fail, change tools, switch branch), with random token ids and two tool sets.
"""

from __future__ import annotations

import numpy as np

from schemas.completions import (
    AssistantMessage,
    CallError,
    ChatMessage,
    Completion,
    Continuation,
    NormalizedRequest,
    ToolCall,
    ToolDefinition,
)

TOOLS = [ToolDefinition(name="shell", description="Run a command " * 20,
                        parameters={"type": "object", "properties": {"command": {"type": "string"}}})]
OTHER_TOOLS = [ToolDefinition(name="edit", parameters={"type": "object", "properties": {"a": {"type": "number"}}})]


def random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 151_643, n).astype(np.int32)


def generated_session(seed: int, steps: list[str], session_id: str = "s-gen") -> list[Completion]:
    """Full events of a session driven by ``steps``: ``continue`` (the current branch, exactly), ``open`` (a
    new branch: another prompt), ``retry`` (the branch's last call again), ``fail`` (a failed call),
    ``tools`` (the next continuation offers other tools), ``switch`` (go back to an older branch)."""
    rng = np.random.default_rng(seed)
    branches: list[dict] = []
    current = -1
    tools = TOOLS
    out: list[Completion] = []

    def emit(prompt: np.ndarray, messages: list[ChatMessage], mode: str, branch: int, *, ok: bool = True,
             opened: str | None = None) -> None:
        sequence = len(out)
        sampled = random_ids(rng, int(rng.integers(1, 40)))
        call = ToolCall(id=f"c{sequence}", name="shell", arguments=f'{{"command": "step {sequence}"}}')
        continuation = Continuation(mode=mode, branch=f"b{branch}", opened=opened)  # type: ignore[arg-type]
        event = Completion(
            session_id=session_id, sequence=sequence, api="openai.chat",
            request=NormalizedRequest(messages=list(messages), tools=tools),
            prompt_token_ids=prompt, token_ids=sampled if ok else None,
            logprobs=np.full(len(sampled), -0.5, dtype=np.float32) if ok else None,
            status="ok" if ok else "error", finish_reason="tool_calls" if ok else None,
            error=None if ok else CallError(kind="engine_error", message="boom"),
            message=AssistantMessage(content=f"reply {sequence}", tool_calls=[call]) if ok else None,
            continuation=continuation)
        out.append(event)
        if ok:
            state = branches[branch]
            state.update(tokens=np.concatenate([prompt, sampled]), prompt=prompt,
                         messages=[*messages, ChatMessage(role="assistant", content=f"reply {sequence}",
                                                          tool_calls=[call])], request=list(messages))

    def open_branch() -> int:
        branches.append({})
        prompt = random_ids(rng, int(rng.integers(300, 600)))
        messages = [ChatMessage(role="system", content=f"system {len(branches)}"),
                    ChatMessage(role="user", content="task")]
        emit(prompt, messages, "rendered", len(branches) - 1, opened="first_call")
        return len(branches) - 1

    for step in ["open", *steps]:
        if step == "open" or current < 0 or not branches[current]:
            current = open_branch()
            continue
        state = branches[current]
        if step == "continue":
            new = random_ids(rng, int(rng.integers(0, 60)))
            messages = [*state["messages"], ChatMessage(role="tool", tool_call_id="x", content=f"out {len(out)}")]
            emit(np.concatenate([state["tokens"], new]), messages, "exact", current)
        elif step == "retry":
            emit(state["prompt"], state["request"], "exact", current)
        elif step == "fail":
            emit(np.concatenate([state["tokens"], random_ids(rng, 5)]), state["messages"], "exact", current, ok=False)
        elif step == "tools":
            tools = OTHER_TOOLS if tools is TOOLS else TOOLS
        elif step == "switch":
            current = int(rng.integers(0, len(branches)))
    return out
