"""The trajectory worker end to end: real broker, real Faust worker process, events in, trajectories out.

Sessions with several completions and an end event must give exactly one Trajectory each, equal to what
``build_trajectory`` makes from the same events directly (same event id, same traces); a poison record
must be dead-lettered while the worker carries on; a session that never ends must be built as partial
once its idle deadline passes.
"""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaProducer

from processors.builders import SessionFacts, build_trajectory
from schemas.dead_letter import DeadLetter
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventProducer
from tests.processors.worker_process import SessionPlan, WorkerProcess, by_session, linear_session, read_events

pytestmark = pytest.mark.kafka


def expected(plan: SessionPlan, *, partial: bool = False) -> Trajectory:
    end = None if partial else plan.end
    facts = SessionFacts(session_id=plan.session_id, task_id=plan.spec.task_id,
                         policy_version=plan.spec.policy_version, status=end.status if end else None,
                         failure=end.failure if end else None, partial=partial,
                         ended_at=end.occurred_at if end else None)
    return build_trajectory(plan.spec.builder, plan.completions, facts)


def same(got: Trajectory, want: Trajectory) -> None:
    assert got.event_id == want.event_id
    assert got.builder == want.builder and got.partial == want.partial
    assert got.session_status == want.session_status and got.task_id == want.task_id
    assert [t.model_dump(mode="json") for t in got.traces] == [t.model_dump(mode="json") for t in want.traces]
    assert got.stats == want.stats


async def test_sessions_become_one_trajectory_each(kafka, tmp_path) -> None:
    plans = [linear_session(f"s{i}", turns=3 + i % 4, seed=i, branch_at=2 if i % 3 == 0 else None,
                            builder="per_request" if i % 4 == 1 else "prefix_merging") for i in range(10)]
    open_plan = linear_session("s-open", turns=3, seed=99, ended=False)
    worker = WorkerProcess(kafka, tmp_path / "data",
                           extra_env={"ROLLWIRE_PROCESSORS_IDLE_S": "4", "ROLLWIRE_PROCESSORS_GRACE_S": "1"})
    worker.start()
    try:
        async with EventProducer(kafka) as producer:
            await producer.send_many([p.spec for p in [*plans, open_plan]])
            # Interleave the sessions' completions, as concurrent sessions would.
            for turn in range(max(len(p.completions) for p in plans)):
                await producer.send_many([p.completions[turn] for p in [*plans, open_plan]
                                          if turn < len(p.completions)])
            raw = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap)
            await raw.start()
            try:
                await raw.send_and_wait(kafka.registry().name(Topic.COMPLETIONS), b"{not json", key=b"s0")
            finally:
                await raw.stop()
            await producer.send_many([p.end for p in plans if p.end is not None])
        events = await read_events(kafka, Topic.TRAJECTORIES, until=len(plans) + 1, timeout_s=60)
        grouped = by_session(events)
        assert set(grouped) == {p.session_id for p in [*plans, open_plan]}, worker.log_tail()
        for plan in plans:
            assert len(grouped[plan.session_id]) == 1
            same(grouped[plan.session_id][0], expected(plan))
        assert grouped["s-open"][0].partial
        same(grouped["s-open"][0], expected(open_plan, partial=True))
        letters = await read_events(kafka, Topic.DEAD_LETTER, until=1, timeout_s=20)
        assert len(letters) == 1 and isinstance(letters[0], DeadLetter)
        assert letters[0].error_type == "invalid_json" and letters[0].source_topic.endswith("completions")
        health = worker.health()
        assert health is not None and health["dead_lettered"] == 1
    finally:
        worker.stop()
