"""What each page shows, as plain data made from the view: session rows and timelines, a session's calls
and branch tree, a trace's layout and its token chunks. No HTML here (templates/), no I/O.

A trace's tokens belong to calls: the trace of a prefix-merged branch is its calls' prompt + sampled ids
stacked, each call's extending the last, so token ``p`` belongs to the first of the trace's calls (in
sequence order) whose prompt + sampled ids reach past ``p`` (the last call takes whatever is left).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from schemas.completions import AssistantMessage, ChatMessage, Completion
from schemas.groups import GroupSample
from schemas.trajectories import Trace, Trajectory
from sinks.ui.tokens import TokenDecoder
from sinks.ui.view import RunView, SessionState, TaskState

ROW_TOKENS = 32
"""At most this many tokens on one row of the trace page (rows also end at line breaks and calls)."""
CHUNK_TOKENS = 4096
"""Tokens per chunk the trace page fetches."""


# -- runs and sessions ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Segment:
    """One stage of a session's timeline: where it starts and how wide it is, as fractions of the run."""

    stage: str
    left: float
    width: float
    seconds: float


@dataclass(slots=True)
class SessionRow:
    session_id: str
    task_id: str | None
    sample: int
    status: str
    failure: str | None
    reason: str | None
    calls: int
    failed_calls: int
    traces: int | None
    reward: float | None
    advantage: float | None
    seconds: float | None
    timeline: list[Segment] = field(default_factory=list)
    cause: str | None = None
    attempt: int = 0
    retry_of: str | None = None
    """The session this one resubmits (it failed for the infrastructure)."""


@dataclass(slots=True)
class TaskBlock:
    """A task with its group's figures and its sessions."""

    task_id: str
    instruction: str | None
    harness: str | None
    samples: int
    group_complete: bool | None
    no_signal: bool | None
    baseline_mean: float | None
    baseline_std: float | None
    estimator: str | None
    sessions: list[SessionRow]


def _span(session: SessionState, now: datetime) -> tuple[datetime, datetime] | None:
    if not session.stages:
        return None
    end = session.ended.occurred_at if session.ended is not None else now
    return session.stages[0].at, max(end, session.stages[-1].at)


def _row(session: SessionState, sample: GroupSample | None, t0: datetime, scale: float, now: datetime) -> SessionRow:
    calls = session.completions.values()
    trajectory = session.trajectory()
    segments: list[Segment] = []
    marks = session.stages
    for index, mark in enumerate(marks):
        if index + 1 < len(marks):
            end = marks[index + 1].at
        else:
            end = session.ended.occurred_at if session.ended is not None else now
        seconds = max(0.0, (end - mark.at).total_seconds())
        segments.append(Segment(mark.stage.value, (mark.at - t0).total_seconds() / scale, seconds / scale, seconds))
    span = _span(session, now)
    ended = session.ended
    return SessionRow(
        session_id=session.session_id, task_id=session.task_id,
        sample=session.spec.sample_index if session.spec else 0, status=session.status,
        failure=ended.failure.value if ended is not None and ended.failure is not None else None,
        reason=ended.reason if ended is not None else None,
        cause=ended.cause.value if ended is not None and ended.cause is not None else None,
        attempt=session.spec.attempt if session.spec else 0,
        retry_of=session.spec.retry_of if session.spec else None,
        calls=len(session.completions), failed_calls=sum(c.status == "error" for c in calls),
        traces=len(trajectory.traces) if trajectory is not None else None,
        reward=sample.reward if sample is not None and sample.reward is not None else session.reward(),
        advantage=sample.advantage if sample is not None else None,
        seconds=(span[1] - span[0]).total_seconds() if span else None, timeline=segments)


def session_rows(sessions: list[SessionState], samples: dict[str, GroupSample] | None = None,
                 now: datetime | None = None) -> list[SessionRow]:
    """Rows with timelines on one time scale (the earliest start to the latest end among ``sessions``)."""
    now = now or datetime.now(timezone.utc)
    spans = [s for s in (_span(session, now) for session in sessions) if s is not None]
    t0 = min((s[0] for s in spans), default=now)
    t1 = max((s[1] for s in spans), default=now)
    scale = max((t1 - t0).total_seconds(), 1e-3)
    samples = samples or {}
    return [_row(s, samples.get(s.session_id), t0, scale, now) for s in sessions]


def task_blocks(view: RunView, tasks: list[TaskState], now: datetime | None = None) -> list[TaskBlock]:
    blocks = []
    for task in tasks:
        group = task.group
        samples = {s.session_id: s for s in group.samples} if group is not None else {}
        request = task.accepted.request if task.accepted is not None else None
        blocks.append(TaskBlock(
            task_id=task.task_id, instruction=request.instruction if request else None,
            harness=request.agent.harness if request else None,
            samples=request.num_samples if request else len(task.session_ids),
            group_complete=group.complete if group else None, no_signal=group.no_signal if group else None,
            baseline_mean=group.baseline_mean if group else None, baseline_std=group.baseline_std if group else None,
            estimator=group.estimator if group else None,
            sessions=session_rows(view.sessions_of(task), samples, now)))
    return blocks


def failure_kinds(sessions: list[SessionState]) -> dict[str, int]:
    """Sessions per way of ending (``status/failure``), and failed calls per error kind (``call:kind``)."""
    counts: Counter[str] = Counter()
    for session in sessions:
        ended = session.ended
        if ended is not None and ended.status.value != "completed":
            counts[f"{ended.status.value}/{ended.failure.value if ended.failure else '-'}"] += 1
        for call in session.completions.values():
            if call.error is not None:
                counts[f"call:{call.error.kind}"] += 1
    return dict(sorted(counts.items()))


def status_counts(sessions: list[SessionState]) -> dict[str, int]:
    return dict(sorted(Counter(s.status for s in sessions).items()))


# -- one session ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class CallRow:
    """One model call as the session page lists it."""

    sequence: int
    event_id: str
    api: str
    model: str | None
    policy_version: str | None
    engine: str | None
    engine_attempts: int
    status: str
    error: str | None
    finish_reason: str | None
    latency_ms: float | None
    ttft_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    branch: str | None
    role: str | None
    mode: str | None
    parent_sequence: int | None
    opened: str | None
    retry_of: int | None
    drift: list[str] | None
    """None: not measured; [] : the re-render matched; else its kinds."""
    drift_at: int | None
    inherited_messages: int
    inherited_from: int | None
    new_messages: list[ChatMessage]
    reply: AssistantMessage | None
    trace: int | None = None


def prompt_length(call: Completion) -> int:
    """The call's whole prompt length, from the event as written (a delta says it)."""
    if call.prompt_delta is not None:
        return call.prompt_delta.prompt_tokens
    return len(call.prompt_token_ids) if call.prompt_token_ids is not None else call.usage.prompt_tokens


def call_rows(session: SessionState, trajectory: Trajectory | None) -> list[CallRow]:
    in_trace = {seq: index for index, trace in enumerate(trajectory.traces) for seq in trace.sequences} \
        if trajectory is not None else {}
    rows = []
    for call in session.calls():
        continuation = call.continuation
        drift = continuation.drift if continuation is not None else None
        timings = call.timings
        delta = call.prompt_delta
        rows.append(CallRow(
            sequence=call.sequence, event_id=call.event_id, api=call.api,
            model=call.served_model or call.requested_model, policy_version=call.policy_version,
            engine=call.engine, engine_attempts=call.engine_attempts,
            status=call.status, error=f"{call.error.kind}: {call.error.message}" if call.error else None,
            finish_reason=call.finish_reason,
            latency_ms=timings.total_ms if timings is not None else None,
            ttft_ms=timings.ttft_ms if timings is not None else None,
            prompt_tokens=prompt_length(call),
            completion_tokens=len(call.token_ids) if call.token_ids is not None else call.usage.completion_tokens,
            branch=continuation.branch if continuation else None, role=continuation.role if continuation else None,
            mode=continuation.mode if continuation else None,
            parent_sequence=continuation.parent_sequence if continuation else None,
            opened=continuation.opened if continuation else None,
            retry_of=continuation.retry_of_sequence if continuation and continuation.retry_of_sequence is not None
            else call.retry_of,
            drift=None if drift is None else (list(drift.kinds) or (["differs"] if drift.differs else [])),
            drift_at=drift.first_divergence if drift is not None else None,
            inherited_messages=delta.messages_prefix if delta is not None else 0,
            inherited_from=delta.parent_sequence if delta is not None else None,
            new_messages=list(call.request.messages), reply=call.message, trace=in_trace.get(call.sequence)))
    return rows


@dataclass(slots=True)
class BranchNode:
    """One trace of the builder's, as a node of the session's branch tree."""

    index: int
    branch: int
    parent_branch: int | None
    role: str
    sequences: list[int]
    tokens: int
    trainable: int
    opened: str | None
    """Why its first call opened a new branch (the proxy's reason), when it says."""
    children: list[BranchNode] = field(default_factory=list)


def branch_tree(trajectory: Trajectory | None, calls: list[CallRow]) -> list[BranchNode]:
    """The builder's traces as a forest: each under the trace of its parent branch."""
    if trajectory is None:
        return []
    opened = {row.sequence: row.opened for row in calls}
    nodes = [BranchNode(index, trace.branch, trace.parent_branch, trace.role, list(trace.sequences),
                        len(trace.token_ids), int(trace.loss_mask.numpy.sum()),
                        opened.get(trace.sequences[0]) if trace.sequences else None)
             for index, trace in enumerate(trajectory.traces)]
    by_branch = {node.branch: node for node in nodes}
    roots = []
    for node in nodes:
        parent = by_branch.get(node.parent_branch) if node.parent_branch is not None else None
        if parent is not None and parent is not node:
            parent.children.append(node)
        else:
            roots.append(node)
    return roots


def message_text(message: ChatMessage | AssistantMessage) -> str:
    """A message's text content (text parts joined, images named)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text or "" if part.type == "text" else f"[{part.type}]" for part in content)


# -- one trace --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CallSpan:
    start: int
    end: int
    sequence: int
    event_id: str


@dataclass(slots=True)
class TraceLayout:
    """Everything the trace page needs before its first chunk: sizes, call spans and row starts."""

    length: int
    trainable: int
    calls: list[CallSpan]
    rows: list[int]
    """The first token of each row."""

    def as_json(self) -> dict[str, Any]:
        return {"length": self.length, "trainable": self.trainable, "chunk": CHUNK_TOKENS,
                "calls": [[c.start, c.end, c.sequence, c.event_id] for c in self.calls], "rows": self.rows}


def call_spans(trace: Trace, calls: dict[int, Completion]) -> list[CallSpan]:
    """Which tokens of ``trace`` each of its calls brought (see the module docstring)."""
    n = len(trace.token_ids)
    spans: list[CallSpan] = []
    start = 0
    ordered = sorted(zip(trace.sequences, trace.completion_ids))
    for index, (sequence, event_id) in enumerate(ordered):
        call = calls.get(sequence)
        if index == len(ordered) - 1:
            end = n
        elif call is None:
            end = start
        else:
            end = prompt_length(call) + (len(call.token_ids) if call.token_ids is not None else 0)
        end = min(n, max(start, end))
        spans.append(CallSpan(start, end, sequence, event_id))
        start = end
    return spans


def trace_layout(trace: Trace, calls: dict[int, Completion], decoder: TokenDecoder) -> TraceLayout:
    ids = trace.token_ids.numpy
    spans = call_spans(trace, calls)
    cuts = {0}
    cuts.update(span.start for span in spans if span.start < len(ids))
    cuts.update(int(p) + 1 for p in decoder.line_ends(ids) if p + 1 < len(ids))
    ordered = sorted(cuts)
    rows: list[int] = []
    for index, start in enumerate(ordered):
        end = ordered[index + 1] if index + 1 < len(ordered) else len(ids)
        rows.extend(range(start, max(end, start + 1), ROW_TOKENS))
    return TraceLayout(len(ids), int(trace.loss_mask.numpy.sum()), spans, rows if len(ids) else [])


def token_chunk(trace: Trace, spans: list[CallSpan], decoder: TokenDecoder, start: int, count: int) -> dict[str, Any]:
    """Tokens ``[start, start + count)``: ids, pieces, mask (a string of 0/1), logprobs (None: NaN) and
    the index of the call each belongs to (into the layout's ``calls``)."""
    n = len(trace.token_ids)
    start = max(0, min(start, n))
    end = max(start, min(n, start + count))
    ids = trace.token_ids.numpy[start:end]
    mask = trace.loss_mask.numpy[start:end]
    logprobs = trace.logprobs.numpy[start:end].astype(np.float64)
    ends = [span.end for span in spans]
    call_index = np.searchsorted(np.asarray(ends, dtype=np.int64), np.arange(start, end), side="right") \
        if spans else np.zeros(end - start, dtype=np.int64)
    rounded = [None if math.isnan(v) else round(v, 4) for v in logprobs.tolist()]
    return {"start": start, "end": end, "ids": ids.tolist(), "text": decoder.pieces(ids),
            "mask": "".join("1" if m else "0" for m in mask.tolist()), "logprobs": rounded,
            "call": np.minimum(call_index, max(0, len(spans) - 1)).tolist()}
