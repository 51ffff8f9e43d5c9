"""One realistic event of every type, for round-trip tests (in memory, through Kafka, as JSON Schema)."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np

from schemas.completions import (
    AssistantMessage,
    CallTimings,
    ChatMessage,
    Completion,
    ContentPart,
    NormalizedRequest,
    SamplingParams,
    ToolCall,
    ToolDefinition,
    Usage,
)
from schemas.call_claims import CallClaim
from schemas.dead_letter import DeadLetter
from schemas.envelope import Event
from schemas.evaluations import Evaluation
from schemas.policy import PolicyRange, ProxyAlive, ProxyDrain, TierGate, WeightsUpdated
from schemas.groups import Group, GroupSample
from schemas.sessions import (
    FailureKind,
    SessionEnded,
    SessionSpec,
    SessionStage,
    SessionStageChanged,
    SessionStatus,
)
from schemas.tasks import AgentSpec, EngineParams, EvaluatorSpec, RuntimeSpec, TaskAccepted, TaskRequest
from schemas.trajectories import Trace, Trajectory, TrajectoryStats


def completion(session_id: str = "sess-1", sequence: int = 0, prompt_len: int = 64,
               sampled_len: int = 12, seed: int = 0) -> Completion:
    rng = np.random.default_rng(seed)
    now = datetime(2026, 11, 22, 12, 0, 0, tzinfo=timezone.utc)
    return Completion(
        session_id=session_id, task_id="task-1", sequence=sequence, api="openai.chat",
        agent_hints={"harness": "qwen-code"}, requested_model="qwen3-coder", served_model="rollwire-tiny",
        policy_version="step-12",
        request=NormalizedRequest(
            messages=[
                ChatMessage(role="system", content="You are a coding agent."),
                ChatMessage(role="user", content=[ContentPart(type="text", text="Fix the failing test.")]),
                ChatMessage(role="assistant", reasoning="look first",
                            tool_calls=[ToolCall(id="call_1", name="shell", arguments='{"command": "ls"}')]),
                ChatMessage(role="tool", tool_call_id="call_1", content="README.md\nsrc\n"),
            ],
            tools=[ToolDefinition(name="shell", description="Run a command",
                                  parameters={"type": "object", "properties": {"command": {"type": "string"}}})],
            tool_choice="auto", sampling=SamplingParams(temperature=1.0, max_tokens=256, seed=3), stream=True,
        ),
        request_digest="ab" * 32,
        prompt_token_ids=rng.integers(0, 151_643, prompt_len).astype(np.int32),
        token_ids=rng.integers(0, 151_643, sampled_len).astype(np.int32),
        logprobs=np.log(rng.uniform(0.01, 1.0, sampled_len)).astype(np.float32),
        finish_reason="tool_calls",
        message=AssistantMessage(content="", tool_calls=[ToolCall(id="call_2", name="shell",
                                                                  arguments='{"command": "pytest"}')]),
        usage=Usage(prompt_tokens=prompt_len, completion_tokens=sampled_len),
        timings=CallTimings(received_at=now, first_token_at=now, finished_at=now, ttft_ms=12.5, total_ms=80.0),
    )


def every_event() -> list[Event]:
    request = TaskRequest(
        task_id="task-1", instruction="Make the tests pass.", num_samples=2,
        runtime=RuntimeSpec(repo="/srv/repos/demo", base_commit="abc123", setup=["pip install -e ."]),
        agent=AgentSpec(harness="qwen-code", model="qwen3-coder"),
        evaluator=EvaluatorSpec(name="pytest"), engine=EngineParams(temperature=1.0, seed=5),
        group_id="g-1", policy_version="step-12", metadata={"dataset": "demo"},
    )
    trace = Trace(trace_id="sess-1/0", branch=0, completion_ids=["c1", "c2"], sequences=[0, 1],
                  token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[float("nan")] * 2 + [-0.5, -0.25])
    return [
        TaskAccepted(task_id="task-1", request=request, session_ids=["sess-1", "sess-2"]),
        SessionSpec(session_id="sess-1", task_id="task-1", sample_index=0, instruction=request.instruction,
                    agent=request.agent, engine=request.engine, api_key="rw-key-1", policy_version="step-12"),
        SessionStageChanged(session_id="sess-1", task_id="task-1", stage=SessionStage.RUNNING, node="gw-1",
                            elapsed_s=1.5),
        SessionEnded(session_id="sess-1", task_id="task-1", status=SessionStatus.ERROR,
                     failure=FailureKind.INFRASTRUCTURE, reason="runtime init failed", exit_code=None,
                     patch="diff --git a/x b/x\n", timings={"init": 1.5}),
        completion(),
        Completion(session_id="sess-1", sequence=1, api="anthropic.messages", status="error",
                   error={"kind": "engine_timeout", "message": "engine took longer than 60 s", "http_status": 504},
                   request=NormalizedRequest(messages=[ChatMessage(role="user", content="hi")])),
        CallClaim(session_id="sess-1", proxy="proxy-a", incarnation="9f2c4e1ab3d07765", request_digest="ab" * 32,
                  retry_count=1),
        Evaluation(session_id="sess-1", task_id="task-1", evaluator="pytest", reward=1.0, passed=True,
                   details={"passed": 12, "failed": 0}),
        Trajectory(session_id="sess-1", task_id="task-1", builder="prefix_merging", traces=[trace],
                   stats=TrajectoryStats(completions=2, traces=1, merged=1, branches=1),
                   policy_versions=PolicyRange(oldest=2, newest=3)),
        Group(task_id="task-1", group_id="g-1", samples=[
            GroupSample(session_id="sess-1", reward=1.0, advantage=0.7, status=SessionStatus.COMPLETED,
                        in_baseline=True),
            GroupSample(session_id="sess-2", reward=None, advantage=None, status=SessionStatus.ERROR,
                        failure=FailureKind.INFRASTRUCTURE, in_baseline=False),
        ], baseline_mean=0.5, baseline_std=0.5, policy_versions=PolicyRange(oldest=2, newest=3)),
        WeightsUpdated(served_model="tiny-qwen3", version="3", previous_version="2", weights_path="/ckpt/3",
                       paused_ms=412.5, load_ms=300.0, held_calls=2, drained_calls=1, update_id="u-3",
                       coordinator="proxy-a", proxies=[
                           ProxyDrain(instance="proxy-a", drained_calls=1, held_calls=2),
                           ProxyDrain(instance="proxy-b", status="absent", error="not heard from for 16.0 s")]),
        TierGate(served_model="tiny-qwen3", update_id="u-3", coordinator="proxy-a", instance="proxy-b",
                 phase="drained", drain=ProxyDrain(instance="proxy-b", drained_calls=3)),
        ProxyAlive(served_model="tiny-qwen3", instance="proxy-b", timeout_s=15.0),
        DeadLetter(source_topic="rollwire.completions", partition=0, offset=7, original_key="c2Vzcy0x",
                   error_type="invalid_json", reason="not JSON", payload="e30=", payload_bytes=2),
    ]
