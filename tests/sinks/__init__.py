"""Tests of the sinks (trainer feed, SFT store). Shared here: builders of the events they consume."""

from __future__ import annotations

import numpy as np

from schemas.completions import AssistantMessage, ChatMessage, Completion, NormalizedRequest, ToolCall
from schemas.evaluations import Evaluation
from schemas.groups import Group, GroupSample
from schemas.policy import PolicyRange
from schemas.sessions import FailureKind, SessionStatus
from schemas.trajectories import Trace, Trajectory


def trajectory(session_id: str, task_id: str, *, length: int = 20, prompt: int = 8, seed: int = 0,
               completion_ids: list[str] | None = None, traces: int = 1, versions: tuple[int, int] | None = None,
               failure: FailureKind | None = None) -> Trajectory:
    """A trajectory whose traces have ``prompt`` context tokens then sampled tokens with logprobs;
    ``versions``: the (oldest, newest) weight versions it was sampled under."""
    rng = np.random.default_rng(seed)
    built = []
    for branch in range(traces):
        tokens = rng.integers(10, 1000, length).astype(np.int32)
        mask = np.r_[np.zeros(prompt), np.ones(length - prompt)].astype(np.uint8)
        logprobs = np.where(mask == 1, -rng.uniform(0.01, 3.0, length), np.nan).astype(np.float32)
        built.append(Trace(trace_id=f"{session_id}/{branch}", branch=branch,
                           completion_ids=completion_ids or [f"{session_id}-c0"],
                           sequences=list(range(len(completion_ids or [0]))),
                           token_ids=tokens, loss_mask=mask, logprobs=logprobs))
    return Trajectory(session_id=session_id, task_id=task_id, builder="prefix_merging",
                      session_status=SessionStatus.ERROR if failure else SessionStatus.COMPLETED, failure=failure,
                      traces=built, policy_versions=PolicyRange(oldest=versions[0], newest=versions[1])
                      if versions else None)


def group(task_id: str, trajectories: list[Trajectory], advantages: list[float | None],
          rewards: list[float | None] | None = None) -> Group:
    """A group over these trajectories; a None advantage marks an infrastructure failure."""
    rewards = rewards or [None if a is None else a for a in advantages]
    samples = []
    for t, advantage, reward in zip(trajectories, advantages, rewards, strict=True):
        failed = advantage is None
        samples.append(GroupSample(
            session_id=t.session_id, trajectory_id=t.event_id, reward=reward, advantage=advantage,
            status=SessionStatus.ERROR if failed else SessionStatus.COMPLETED,
            failure=FailureKind.INFRASTRUCTURE if failed else None, in_baseline=not failed))
    ranges = [t.policy_versions for t in trajectories if t.policy_versions is not None]
    versions = None
    if ranges:
        versions = PolicyRange(oldest=min(r.oldest for r in ranges), newest=max(r.newest for r in ranges))
    return Group(task_id=task_id, group_id=f"g-{task_id}", samples=samples, policy_versions=versions,
                 evaluator="tests")


def completion(session_id: str, task_id: str, sequence: int, *, user: str, answer: str,
               event_id: str | None = None) -> Completion:
    """A completion whose request is a system + user conversation and whose reply is ``answer``."""
    extra = {"event_id": event_id} if event_id else {}
    return Completion(
        session_id=session_id, task_id=task_id, sequence=sequence, api="openai.chat",
        request=NormalizedRequest(messages=[ChatMessage(role="system", content="You are a coding agent."),
                                            ChatMessage(role="user", content=user)]),
        prompt_token_ids=np.arange(5, dtype=np.int32), token_ids=np.arange(3, dtype=np.int32),
        logprobs=np.full(3, -0.5, dtype=np.float32), finish_reason="stop",
        message=AssistantMessage(content=answer, tool_calls=[
            ToolCall(id="call_1", name="shell", arguments='{"command": "pytest"}')]),
        **extra)


def evaluation(session_id: str, task_id: str, reward: float, evaluator: str = "tests") -> Evaluation:
    return Evaluation(session_id=session_id, task_id=task_id, evaluator=evaluator, reward=reward,
                      passed=reward >= 1)
