"""The builders on completion events recorded from the real CLIs on the real vLLM engine.

``tests/fixtures/sessions/<cli>-<n>.jsonl`` (written by ``record_sessions.py`` beside them): Codex, Claude
Code, Qwen Code and Pi each ran a scripted five-call tool session through the proxy. These are real
events: prompts of 1.6k-20k tokens, sampled ids and logprobs as vLLM returned them. Each turn was forced
by token ids (the engine's ``rollwire_forced_tokens`` logits processor): the model sampled the ids the chat
template renders for it, ``<tool_call>`` and ``<|im_end|>`` as their special tokens, with the model's own
(raw) logprobs. So a call's prompt extends the previous prompt plus the previous call's sampled ids, and
prefix_merging makes one row of each session, as it would of a real model's.

Without Kafka: both builders' invariants on every recorded session. With the real broker and a real Faust
worker: the recorded sessions (re-keyed under fresh session ids) become the trajectories
``build_trajectory`` makes of the same events.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bench.merge import recorded_by_cli
from processors.builders import SessionFacts, build_trajectory
from schemas.completions import Completion
from schemas.envelope import new_event_id
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventProducer
from tests.processors.worker_process import expected, same
from tests.processors.worker_process import SessionPlan, WorkerProcess, by_session, read_events

SESSIONS_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"
RECORDED = recorded_by_cli(SESSIONS_DIR)
SESSIONS = [(f"{cli}-{i}", events) for cli, sessions in RECORDED.items() for i, events in enumerate(sessions, 1)]
CLIS = {"codex", "claude-code", "qwen-code", "pi"}
TOOL_CALL_ID, TOOL_CALL_END_ID, IM_END_ID = 151657, 151658, 151645  # <tool_call>, </tool_call>, <|im_end|>


def usable(events: list[Completion]) -> list[Completion]:
    return sorted((e for e in events if e.status == "ok" and e.prompt_token_ids is not None
                   and e.token_ids is not None), key=lambda e: e.sequence)


def build(name: str, events: list[Completion]) -> Trajectory:
    return build_trajectory(name, events, SessionFacts(session_id=events[0].session_id))


def test_every_cli_has_a_recorded_multi_turn_session() -> None:
    assert set(RECORDED) >= CLIS, f"re-record: python {SESSIONS_DIR / 'record_sessions.py'}"
    for cli in CLIS:
        for events in RECORDED[cli]:
            assert len(usable(events)) >= 4, cli
            assert len({e.api for e in events}) == 1
            assert max(len(e.prompt_token_ids) for e in events) > 1000, cli
    for path in SESSIONS_DIR.glob("*.jsonl"):
        assert path.stat().st_size < 2 * 1024 * 1024, f"{path.name} is too big for the repository"


@pytest.mark.parametrize(("name", "events"), SESSIONS, ids=[name for name, _ in SESSIONS])
def test_recorded_events_are_as_vllm_returned_them(name: str, events: list[Completion]) -> None:
    """The CLIs keep their history append-only (each prompt starts with the previous prompt) and every
    sampled token has a logprob; the JSON lines decode back to themselves."""
    calls = usable(events)
    assert [e.sequence for e in calls] == list(range(len(calls)))
    for event in calls:
        assert len(event.logprobs) == len(event.token_ids) > 0
        assert not np.isnan(event.logprobs.numpy).any() and (event.logprobs.numpy <= 0).all()
        assert Completion.model_validate_json(event.model_dump_json()) == event
    for earlier, later in zip(calls, calls[1:]):
        prompt = earlier.prompt_token_ids.numpy
        assert np.array_equal(later.prompt_token_ids.numpy[:len(prompt)], prompt), f"{name}: history rewritten"
    assert calls[-1].finish_reason == "stop" and all(c.finish_reason == "tool_calls" for c in calls[:-1])


@pytest.mark.parametrize(("name", "events"), SESSIONS, ids=[name for name, _ in SESSIONS])
def test_turns_were_sampled_as_the_template_writes_them(name: str, events: list[Completion]) -> None:
    """Every tool-call turn sampled ``<tool_call>`` … ``</tool_call>`` as the special ids and every turn ended
    on ``<|im_end|>``, each forced id with the model's own logprob (recorded under raw_logprobs: a random
    model gives every id a probability well below 1, never the forcing distribution's 0.0)."""
    calls = usable(events)
    for call in calls:
        ids = call.token_ids.tolist()
        assert ids[-1] == IM_END_ID, (name, call.sequence)
        if call.finish_reason == "tool_calls":
            assert ids[0] == TOOL_CALL_ID and ids[-2] == TOOL_CALL_END_ID, (name, call.sequence)
        assert (call.logprobs.numpy < -1.0).all(), (name, call.sequence)


@pytest.mark.parametrize(("name", "events"), SESSIONS, ids=[name for name, _ in SESSIONS])
def test_prefix_merging_makes_one_row_per_session(name: str, events: list[Completion]) -> None:
    """The sessions are linear (one agent, append-only history): one trace whose tokens are the last call's
    prompt plus its sampled ids, every call merged into it."""
    calls = usable(events)
    trajectory = build("prefix_merging", events)
    assert trajectory.stats.branches == len(trajectory.traces) == 1, name
    assert trajectory.stats.merged == len(calls) - 1
    [trace] = trajectory.traces
    last = calls[-1]
    assert np.array_equal(trace.token_ids.numpy, np.concatenate([last.prompt_token_ids.numpy, last.token_ids.numpy]))


@pytest.mark.parametrize(("name", "events"), SESSIONS, ids=[name for name, _ in SESSIONS])
def test_per_request_is_one_row_per_usable_completion(name: str, events: list[Completion]) -> None:
    trajectory = build("per_request", events)
    calls = usable(events)
    assert len(trajectory.traces) == len(calls) and not trajectory.stats.problems
    for trace, call in zip(sorted(trajectory.traces, key=lambda t: t.sequences[0]), calls, strict=True):
        assert trace.completion_ids == [call.event_id]
        full = np.concatenate([call.prompt_token_ids.numpy, call.token_ids.numpy])
        assert np.array_equal(trace.token_ids.numpy, full)
        assert int(trace.loss_mask.numpy.sum()) == len(call.token_ids)
        assert np.array_equal(trace.logprobs.numpy[len(call.prompt_token_ids):], call.logprobs.numpy)


@pytest.mark.parametrize(("name", "events"), SESSIONS, ids=[name for name, _ in SESSIONS])
def test_prefix_merging_trains_every_sampled_token_once(name: str, events: list[Completion]) -> None:
    """Every usable call is in exactly one trace, its sampled ids at its prompt's length with mask 1 and
    their logprobs; nothing else has mask 1; a trace's arrays have one length, its last call's prompt +
    sampled ids; a call joins its predecessor's trace exactly when its prompt extends that call's
    prompt + sampled ids."""
    trajectory = build("prefix_merging", events)
    calls = usable(events)
    by_id = {c.event_id: c for c in calls}
    stats = trajectory.stats
    assert not stats.problems and stats.missing_logprobs == 0 and stats.rejected == len(events) - len(calls)
    assert stats.branches == len(trajectory.traces) and stats.merged + stats.branches == len(calls)
    assert Counter(i for t in trajectory.traces for i in t.completion_ids) == Counter(list(by_id))

    trace_of: dict[str, int] = {}
    trained = 0
    for trace in trajectory.traces:
        tokens, mask, logprobs = trace.token_ids.numpy, trace.loss_mask.numpy, trace.logprobs.numpy
        assert len(tokens) == len(mask) == len(logprobs)
        members = [by_id[i] for i in trace.completion_ids]
        assert trace.sequences == [c.sequence for c in members]
        last = members[-1]
        assert np.array_equal(tokens, np.concatenate([last.prompt_token_ids.numpy, last.token_ids.numpy]))
        expected_mask = np.zeros(len(tokens), dtype=bool)
        for call in members:
            trace_of[call.event_id] = trace.branch
            start, count = len(call.prompt_token_ids), len(call.token_ids)
            assert np.array_equal(tokens[start:start + count], call.token_ids.numpy)
            assert (mask[start:start + count] == 1).all()
            assert np.array_equal(logprobs[start:start + count], call.logprobs.numpy)
            expected_mask[start:start + count] = True
        assert np.array_equal(mask.astype(bool), expected_mask)
        assert np.isnan(logprobs[~expected_mask]).all()
        trained += int(mask.sum())
    assert trained == sum(len(c.token_ids) for c in calls)

    for earlier, later in zip(calls, calls[1:]):
        head = np.concatenate([earlier.prompt_token_ids.numpy, earlier.token_ids.numpy])
        extends = len(later.prompt_token_ids) >= len(head) and np.array_equal(
            later.prompt_token_ids.numpy[:len(head)], head)
        assert (trace_of[later.event_id] == trace_of[earlier.event_id]) == extends, (name, later.sequence)


def rekeyed(events: list[Completion], session_id: str) -> list[Completion]:
    """The same calls under another session id, as fresh events (new event ids)."""
    return [e.model_copy(update={"session_id": session_id, "event_id": new_event_id()}) for e in events]


@pytest.mark.kafka
async def test_recorded_sessions_through_the_broker_and_a_worker(kafka, tmp_path) -> None:
    """Each recorded session, re-keyed under a fresh session id, once per builder: its spec, completions
    and end through the real broker; a real Faust worker emits exactly the trajectory ``build_trajectory``
    makes of the same events."""
    plans = []
    for name, events in SESSIONS:
        for builder in ("prefix_merging", "per_request"):
            session_id = f"rec-{name}-{builder}-{uuid.uuid4().hex[:6]}"
            spec = SessionSpec(session_id=session_id, task_id=f"task-{name}", builder=builder)
            end = SessionEnded(session_id=session_id, task_id=spec.task_id, status=SessionStatus.COMPLETED)
            plans.append(SessionPlan(spec, rekeyed(events, session_id), end))
    worker = WorkerProcess(kafka, tmp_path / "data")
    worker.start()
    try:
        async with EventProducer(kafka) as producer:
            await producer.send_many([p.spec for p in plans])
            for plan in plans:
                await producer.send_many(plan.completions)
            await producer.send_many([p.end for p in plans])
        got = by_session(await read_events(kafka, Topic.TRAJECTORIES, until=len(plans), timeout_s=90))
        assert set(got) == {p.session_id for p in plans}, worker.log_tail()
        for plan in plans:
            [trajectory] = got[plan.session_id]
            want = expected(plan)
            same(trajectory, want)
            assert len(trajectory.traces) == (len(usable(plan.completions)) if plan.spec.builder == "per_request"
                                              else want.stats.branches)
    finally:
        worker.stop()
