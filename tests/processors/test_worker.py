"""The trajectory worker end to end: real broker, real Faust worker process, events in, trajectories out.

Sessions with several completions and an end event must give exactly one Trajectory each, equal to what
``build_trajectory`` makes from the same events directly (same event id, same traces); a poison record
must be dead-lettered while the worker carries on; a session that never ends must be built as partial
once its deadline (its spec's timeout plus the grace) passes.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from processors.trajectories.rebuild import RebuildRequest, rebuild
from processors.trajectories.topics import prepare_topics
from schemas.dead_letter import DeadLetter
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, EventProducer, KafkaSettings, topic_spec
from schemas.transport.admin import delete_topics
from tests.processors.worker_process import (
    WorkerProcess, by_session, expected, linear_session, read_events, same)

pytestmark = pytest.mark.kafka


async def _read_rebuilt(kafka: KafkaSettings, topic: str, until: int) -> dict[str, Trajectory]:
    """The trajectories on a rebuild's target topic, by session."""
    spec = topic_spec(kafka, topic, like=Topic.TRAJECTORIES)
    out: dict[str, Trajectory] = {}
    async with EventConsumer(kafka, [spec], group_id=None, dead_letters=False) as consumer:
        for _ in range(60):
            for received in await consumer.getmany(timeout_ms=500):
                assert isinstance(received.event, Trajectory)
                out[received.event.session_id] = received.event
            if len(out) >= until:
                break
    return out


async def test_sessions_become_one_trajectory_each(kafka, tmp_path) -> None:
    plans = [linear_session(f"s{i}", turns=3 + i % 4, seed=i, branch_at=2 if i % 3 == 0 else None,
                            builder="per_request" if i % 4 == 1 else "prefix_merging",
                            versions=["2", "2", "3"] if i % 2 == 0 else None, straddle=i % 4 == 0)
             for i in range(10)]
    open_plan = linear_session("s-open", turns=3, seed=99, ended=False)
    # Never ended: built as partial at its spec's timeout plus the grace (its idle time does not count).
    open_plan.spec = open_plan.spec.model_copy(update={"timeout_s": 4.0})
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
        # versions 2, 2, 3 (and on some, a last call straddling 3 -> 4) give the range.
        ranges = {p.session_id: grouped[p.session_id][0].policy_versions for p in plans}
        assert ranges["s0"] is not None and (ranges["s0"].oldest, ranges["s0"].newest) == (2, 4)
        assert ranges["s2"] is not None and (ranges["s2"].oldest, ranges["s2"].newest) == (2, 3)
        assert ranges["s1"] is None  # labels (step-3) are no version numbers
        # `rollwire rebuild` with the same builder re-derives what the worker emitted, ranges included.
        merged = [p for p in plans if p.spec.builder == "prefix_merging"]
        target = kafka.topic_prefix + "rebuilt"
        await rebuild(kafka, RebuildRequest(builder="prefix_merging", to_topic=target,
                                            sessions=frozenset(p.session_id for p in merged)))
        rebuilt = await _read_rebuilt(kafka, target, until=len(merged))
        assert set(rebuilt) == {p.session_id for p in merged}
        for plan in merged:
            assert rebuilt[plan.session_id].event_id == grouped[plan.session_id][0].event_id
            assert rebuilt[plan.session_id].policy_versions == ranges[plan.session_id]
        assert grouped["s-open"][0].partial
        same(grouped["s-open"][0], expected(open_plan, partial=True))
        letters = await read_events(kafka, Topic.DEAD_LETTER, until=1, timeout_s=20)
        assert len(letters) == 1 and isinstance(letters[0], DeadLetter)
        assert letters[0].error_type == "invalid_json" and letters[0].source_topic.endswith("completions")
        health = worker.health()
        assert health is not None and health["dead_lettered"] == 1
    finally:
        worker.stop()


async def test_two_topic_prefixes_on_one_cluster_keep_their_own_state(kafka_bootstrap, tmp_path) -> None:
    """Two deployments (topic prefixes) on one cluster with the same ROLLWIRE_PROCESSORS_DATA_DIR, one after
    the other, as `ROLLWIRE_TOPIC_PREFIX=... rollwire rollout` on one machine does: each worker's tables
    are its own app's. Shared, the second worker found the first one's persisted changelog offsets beyond
    its own empty changelogs and stopped (Faust's ConsistencyError)."""
    deployments = [KafkaSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
                                 session_partitions=1, task_partitions=1) for _ in range(2)]
    try:
        for n, settings in enumerate(deployments):
            await prepare_topics(settings, "processors")
            plans = [linear_session(f"d{n}-s{i}", turns=2, seed=7 + i) for i in range(3)]
            worker = WorkerProcess(settings, tmp_path / "data", app_id="processors")
            worker.start()
            try:
                async with EventProducer(settings) as producer:
                    for plan in plans:
                        assert plan.end is not None
                        await producer.send_many([plan.spec, *plan.completions, plan.end])
                grouped = by_session(await read_events(settings, Topic.TRAJECTORIES, until=len(plans), timeout_s=60))
                assert set(grouped) == {p.session_id for p in plans}, worker.log_tail()
                for plan in plans:
                    same(grouped[plan.session_id][0], expected(plan))
                await asyncio.sleep(3)  # past a few commits: the tables' persisted offsets are written
            finally:
                worker.stop()
        apps = {path.name for path in (tmp_path / "data").glob("cluster-*/*")}
        assert apps == {settings.topic_prefix + "processors" for settings in deployments}
    finally:
        for settings in deployments:
            await delete_topics(kafka_bootstrap, settings.topic_prefix)
