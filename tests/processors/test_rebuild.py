"""``rollwire rebuild`` re-derives trajectories from the retained log with another builder.

The log holds sessions recorded for prefix_merging; a rebuild with per_request must give, for every
ended session, exactly what per_request makes of the same events (one row per completion), on the
target topic; ``--sessions`` selects; a session that never ended is skipped.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from aiokafka import AIOKafkaConsumer

from processors.builders import SessionFacts, build_trajectory
from processors.trajectories.rebuild import RebuildRequest, rebuild
from schemas.codec import decode_event
from schemas.trajectories import Trajectory
from schemas.transport import EventProducer
from tests.processors.worker_process import ROOT, SessionPlan, linear_session

pytestmark = pytest.mark.kafka


def per_request(plan: SessionPlan) -> Trajectory:
    assert plan.end is not None
    facts = SessionFacts(session_id=plan.session_id, task_id=plan.spec.task_id,
                         policy_version=plan.spec.policy_version, status=plan.end.status,
                         ended_at=plan.end.occurred_at)
    return build_trajectory("per_request", plan.completions, facts)


async def read_topic(bootstrap: str, topic: str, until: int) -> list[Trajectory]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    out: list[Trajectory] = []
    try:
        for _ in range(40):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(decode_event(r.value) for r in records)  # type: ignore[misc]
            if len(out) >= until:
                break
    finally:
        await consumer.stop()
    return out


async def _log(kafka) -> list[SessionPlan]:
    plans = [linear_session(f"r{i}", turns=2 + i, seed=i, versions=["4", "5"] if i % 2 else None)
             for i in range(4)]
    plans.append(linear_session("r-open", turns=2, seed=9, ended=False))
    async with EventProducer(kafka) as producer:
        await producer.send_many([p.spec for p in plans])
        await producer.send_many([c for p in plans for c in p.completions])
        await producer.send_many([p.end for p in plans if p.end is not None])
    return plans


async def test_rebuild_with_the_other_builder(kafka) -> None:
    plans = await _log(kafka)
    target = kafka.topic_prefix + "rebuilt-per-request"
    counts = await rebuild(kafka, RebuildRequest(builder="per_request", to_topic=target))
    assert counts["trajectories"] == 4 and counts["open_skipped"] == 1
    got = {t.session_id: t for t in await read_topic(kafka.kafka_bootstrap, target, until=4)}
    assert set(got) == {p.session_id for p in plans if p.end is not None}
    for plan in plans[:4]:
        want = per_request(plan)
        assert got[plan.session_id].event_id == want.event_id
        assert got[plan.session_id].builder == "per_request"
        assert len(got[plan.session_id].traces) == len(plan.completions)  # one row per completion
        assert [t.model_dump(mode="json") for t in got[plan.session_id].traces] == \
            [t.model_dump(mode="json") for t in want.traces]
        assert got[plan.session_id].policy_versions == want.policy_versions
    assert got["r1"].policy_versions is not None and got["r0"].policy_versions is None
    assert (got["r1"].policy_versions.oldest, got["r1"].policy_versions.newest) == (4, 5)


async def test_rebuild_cli_selects_sessions(kafka) -> None:
    plans = await _log(kafka)
    target = kafka.topic_prefix + "rebuilt-one"
    env = {"ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap, "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix,
           "ROLLWIRE_SESSION_PARTITIONS": str(kafka.session_partitions),
           "ROLLWIRE_TASK_PARTITIONS": str(kafka.task_partitions), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "rebuild", "--builder", "per_request",
                           "--sessions", "r2", "--to", target], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "trajectories=1" in done.stdout
    got = await read_topic(kafka.kafka_bootstrap, target, until=1)
    assert [t.session_id for t in got] == ["r2"]
    assert got[0].event_id == per_request(plans[2]).event_id
