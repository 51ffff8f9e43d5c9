"""Hand-made completion events for builder tests: token ids in, a valid Completion out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from schemas.completions import (
    BranchRole,
    CallError,
    ChatMessage,
    Completion,
    Continuation,
    Drift,
    DriftKind,
    NormalizedRequest,
)

SESSION = "sess-b"


def logprob_of(token: int) -> float:
    """The logprob every test gives a sampled token: derived from the token, so it can be checked anywhere."""
    return float(np.float32(-(token % 997 + 1) / 128))


def continuation(*, mode: Literal["exact", "rendered"] = "exact", branch: str = "b0", role: BranchRole = "main",
                 parent_sequence: int | None = None, closed_cut_turn: bool = False,
                 retry_of_sequence: int | None = None, drift: Sequence[DriftKind] | None = ()) -> Continuation:
    """A continuation block as the proxy writes it; ``drift``: the kinds of a differing re-render, empty for
    a re-render that matched, None for no drift measured."""
    measured = None if drift is None else Drift(differs=bool(drift), kinds=list(drift), rendered_prompt_tokens=0)
    return Continuation(mode=mode, branch=branch, role=role, parent_sequence=parent_sequence,
                        closed_cut_turn=closed_cut_turn, retry_of_sequence=retry_of_sequence, drift=measured)


def make_call(sequence: int, prompt: Sequence[int], sampled: Sequence[int], *, logprobs: object = "derive",
              status: str = "ok", retry_of: int | None = None, finish_reason: str | None = "stop",
              session_id: str = SESSION, event_id: str | None = None, policy_version: str | None = None,
              continued: Continuation | None = None) -> Completion:
    """A completion of ``session_id``; ``continued`` is its continuation block (None: an older event)."""
    if isinstance(logprobs, str):
        logprobs = np.asarray([logprob_of(t) for t in sampled], dtype=np.float32)
    extra = {"event_id": event_id} if event_id else {}
    failed = status == "error"
    return Completion(
        session_id=session_id, sequence=sequence, api="openai.chat", policy_version=policy_version,
        request=NormalizedRequest(messages=[ChatMessage(role="user", content="(test)")]),
        retry_of=retry_of, retry_count=int(retry_of is not None), status=status,
        error=CallError(kind="engine_error", message="boom") if failed else None,
        prompt_token_ids=None if failed else np.asarray(prompt, dtype=np.int32),
        token_ids=None if failed else np.asarray(sampled, dtype=np.int32),
        logprobs=None if failed else logprobs,
        finish_reason=None if failed else finish_reason, continuation=continued, **extra)


def full(call: Completion) -> list[int]:
    """A call's prompt followed by its sampled ids."""
    return call.prompt_token_ids.tolist() + call.token_ids.tolist()
