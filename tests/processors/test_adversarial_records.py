"""Consumers given adversarial records on a real broker (found by an audit of this round; each test failed
before its fix).

The standard: a record a consumer cannot take becomes a dead letter with its reason (never a crash, a
stuck partition, a silent drop or a wrong trajectory); nothing already accepted is lost; one session's
records never change another session's trajectory, evaluation or SFT row.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

from processors.builders import SessionFacts, build_trajectory
from processors.evaluators.runner import EvaluatorRunner
from processors.evaluators.session_completed import SessionCompleted
from schemas.codec import encode_record
from schemas.completions import ChatMessage, NormalizedRequest
from schemas.dead_letter import DeadLetter
from schemas.envelope import Event
from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec, SessionStage, SessionStageChanged, SessionStatus
from schemas.tasks import EvaluatorSpec
from schemas.topics import Topic
from schemas.transport import EventProducer, KafkaSettings
from sinks.sft import SftCriteria, SftStore
from tests.processors.worker_process import WorkerProcess, by_session, linear_session, read_events

# An undecodable record whose dead letter was larger than the record limit although the record itself fits
# under it (the payload cut to half the limit, then base64, plus its headers whole in base64).
BIG_VALUE = b"\x00" * 4_500_000
BIG_HEADERS = [("h", b"x" * 3_000_000)]


def _partition(key: str, partitions: int) -> int:
    return (murmur2(key.encode("utf-8")) & 0x7FFFFFFF) % partitions


async def _raw(kafka: KafkaSettings, topic: Topic, value: bytes | None, *, key: bytes | None,
               headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap, max_request_size=9_000_000)
    await producer.start()
    try:
        await producer.send_and_wait(kafka.registry().name(topic), value, key=key, headers=headers or [],
                                     partition=partition)
    finally:
        await producer.stop()


async def _raw_event(kafka: KafkaSettings, event: Event, *, key: bytes | None, partition: int | None = None) -> None:
    record = encode_record(event, "audit")
    await _raw(kafka, event.topic, record.value, key=key, headers=record.headers, partition=partition)


def _worker(kafka: KafkaSettings, tmp_path: Path, **env: str) -> WorkerProcess:
    return WorkerProcess(kafka, tmp_path / "data", extra_env={"ROLLWIRE_PROCESSORS_BUILD_PROCESSES": "0", **env})


@pytest.mark.kafka
async def test_a_session_event_on_another_partition_does_not_cost_the_session_its_calls(kafka, tmp_path) -> None:
    """A ``session.stage`` of s-mis with a null key lands on partition P (not s-mis's). The worker opened
    the session there and recorded s-mis's later completions as offsets of P's ``completions`` partition,
    so the build read the wrong partition: the trajectory came out with 0 of its 3 calls, no dead letter
    (``lost`` 3; had P held records at those offsets, it would have read another session's calls)."""
    worker = _worker(kafka, tmp_path)
    worker.start()
    try:
        plan = linear_session("s-mis", turns=3, seed=2)
        wrong = (_partition("s-mis", kafka.session_partitions) + 1) % kafka.session_partitions
        async with EventProducer(kafka) as producer:
            await producer.send(plan.spec)
            await _raw_event(kafka, SessionStageChanged(session_id="s-mis", stage=SessionStage.RUNNING),
                             key=None, partition=wrong)
            await asyncio.sleep(2)
            await producer.send_many(plan.completions)
            assert plan.end is not None
            await producer.send(plan.end)
        grouped = by_session(await read_events(kafka, Topic.TRAJECTORIES, until=1, timeout_s=60))
        assert "s-mis" in grouped, worker.log_tail()
        built = {c for trajectory in grouped["s-mis"] for trace in trajectory.traces for c in trace.completion_ids}
        assert built == {c.event_id for c in plan.completions}, worker.log_tail()
    finally:
        worker.stop()


@pytest.mark.kafka
async def test_a_record_whose_dead_letter_is_too_large_does_not_stall_the_worker(kafka, tmp_path) -> None:
    """A non-JSON completion record under the record limit with large headers: its dead letter (payload
    cut to half the limit, but headers and key copied whole, base64) is over the limit, the send fails,
    the agent crashes and is restarted on the same record forever: the partition is stuck and the valid
    session behind it is never built."""
    worker = _worker(kafka, tmp_path)
    worker.start()
    try:
        await _raw(kafka, Topic.COMPLETIONS, BIG_VALUE, key=b"s-ok", headers=BIG_HEADERS)
        plan = linear_session("s-ok", turns=3, seed=1)
        assert plan.end is not None
        async with EventProducer(kafka) as producer:
            await producer.send_many([plan.spec, *plan.completions, plan.end])
        grouped = by_session(await read_events(kafka, Topic.TRAJECTORIES, until=1, timeout_s=60))
        assert "s-ok" in grouped, worker.log_tail()
        letters = await read_events(kafka, Topic.DEAD_LETTER, until=1, timeout_s=10)
        assert any(isinstance(d, DeadLetter) and d.payload_bytes == len(BIG_VALUE) for d in letters)
    finally:
        worker.stop()


async def _evaluations(kafka: KafkaSettings, send: list[tuple[Event, bytes | None] | tuple[bytes, list]],
                       until: int) -> tuple[list[Evaluation], BaseException | None]:
    """Run the session_completed evaluator (all sessions) over what ``send`` writes to session-events;
    the evaluations it emitted, and what the runner raised, if it died."""
    stop = asyncio.Event()
    runner = EvaluatorRunner(kafka, SessionCompleted(), select_all=True)
    task = asyncio.create_task(runner.run(stop))
    died: BaseException | None = None
    try:
        for item in send:
            if isinstance(item[0], bytes):
                await _raw(kafka, Topic.SESSION_EVENTS, item[0], key=b"s-any", headers=item[1])
            else:
                await _raw_event(kafka, item[0], key=item[1])
            await asyncio.sleep(1)
        events = await read_events(kafka, Topic.EVALUATIONS, until=until, timeout_s=30)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 30)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            died = exc
    return [e for e in events if isinstance(e, Evaluation)], died


@pytest.mark.kafka
async def test_the_evaluator_does_not_score_a_session_end_keyed_by_another_session(kafka) -> None:
    """A ``session.ended`` of session B written under key A (the trajectory worker dead-letters it as
    ``key_mismatch``) was scored as B's end: a record in A's key space set B's reward."""
    async with EventProducer(kafka) as producer:
        await producer.send(SessionSpec(session_id="B", evaluator=EvaluatorSpec(name="session_completed")))
    forged = SessionEnded(session_id="B", status=SessionStatus.COMPLETED)
    evaluations, died = await _evaluations(kafka, [(forged, b"A")], until=1)
    assert died is None
    assert [e for e in evaluations if e.session_id == "B"] == []
    letters = await read_events(kafka, Topic.DEAD_LETTER, until=1, timeout_s=10)
    assert any(isinstance(d, DeadLetter) and d.error_type == "key_mismatch" for d in letters)


@pytest.mark.kafka
async def test_an_event_id_reused_by_another_session_does_not_hide_a_sessions_end(kafka) -> None:
    """Session C's end and session D's end carry the same event id: the consumer's de-duplication (by
    event id alone, across sessions) dropped D's end, so D was never evaluated and nothing said so."""
    c_end = SessionEnded(event_id="shared-end-id", session_id="C", status=SessionStatus.ERROR)
    d_end = SessionEnded(event_id="shared-end-id", session_id="D", status=SessionStatus.COMPLETED)
    evaluations, died = await _evaluations(kafka, [(c_end, b"C"), (d_end, b"D")], until=2)
    assert died is None
    assert {e.session_id for e in evaluations} == {"C", "D"}


@pytest.mark.kafka
async def test_a_record_whose_dead_letter_is_too_large_does_not_kill_the_evaluator(kafka) -> None:
    """The same oversized dead letter through schemas.transport.EventConsumer: EventTooLargeError ends
    the evaluator's run, and the sessions after the record are never scored."""
    after = SessionEnded(session_id="E", status=SessionStatus.COMPLETED)
    evaluations, died = await _evaluations(kafka, [(BIG_VALUE, BIG_HEADERS), (after, b"E")], until=1)
    assert died is None, repr(died)
    assert [e.session_id for e in evaluations] == ["E"]


def test_a_completion_of_another_session_never_fills_a_sessions_sft_row(tmp_path: Path) -> None:
    """The SFT store keeps conversations by completion event id alone and does not check the session: a
    completion of session A reusing the id of B's last call, read first (partitions replay in any order),
    became the messages of B's accepted row."""
    plan = linear_session("B", turns=2, seed=5)
    assert plan.end is not None
    facts = SessionFacts(session_id="B", task_id=plan.spec.task_id, status=plan.end.status,
                         ended_at=plan.end.occurred_at)
    trajectory = build_trajectory("prefix_merging", plan.completions, facts)
    last = plan.completions[-1]
    foreign = last.model_copy(update={"session_id": "A", "request": NormalizedRequest(
        messages=[ChatMessage(role="user", content="session A's secret")])})
    store = SftStore(tmp_path, SftCriteria(min_reward=1.0))
    for event in [foreign, *plan.completions, trajectory,
                  Evaluation(session_id="B", evaluator="session_completed", reward=1.0)]:
        store.take(event)
    store.finish()
    store.close()
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines() if line.strip()]
    assert rows and all(r["session_id"] == "B" for r in rows)
    assert not any("session A's secret" in (m["content"] or "") for r in rows for m in r["messages"])
