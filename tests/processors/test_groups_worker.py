"""The groups worker end to end: real broker, a real ``rollwire groups`` worker process, groups out.

Tasks, trajectories and evaluations go onto their topics (in awkward orders: evaluations before their
task, facts of several tasks interleaved); the worker must emit exactly one Group per task once all its
samples are in, with the task's evaluator's rewards and the right advantages; at the deadline a task with
enough samples must be emitted incomplete (the missing one flagged for resubmission) and one with too few
must not; a redelivered fact after emission must not emit again; a poison record must be dead-lettered.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from processors.groups.assembly import group_event_id
from schemas.dead_letter import DeadLetter
from schemas.evaluations import Evaluation
from schemas.groups import Group
from schemas.policy import PolicyRange
from schemas.sessions import FailureKind, SessionStatus
from schemas.tasks import AgentSpec, EvaluatorSpec, TaskAccepted, TaskRequest
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventProducer, KafkaSettings
from tests.processors.worker_process import WorkerProcess, read_events

pytestmark = pytest.mark.kafka


def groups_worker(kafka: KafkaSettings, data_dir: Path, *, extra_env: dict[str, str] | None = None,
                 app_id: str | None = None) -> WorkerProcess:
    """A ``rollwire groups`` worker subprocess."""
    return WorkerProcess(kafka, data_dir, app_id=app_id or f"groups-{uuid.uuid4().hex[:6]}",
                         extra_env=extra_env or {}, command="groups", settings_prefix="ROLLWIRE_GROUPS_")


def accepted(task_id: str, n: int, *, timeout_s: float, evaluator: str | None = "tests") -> TaskAccepted:
    request = TaskRequest(task_id=task_id, instruction="fix add", num_samples=n, timeout_s=timeout_s,
                          agent=AgentSpec(harness="codex"), policy_version="step-7",
                          evaluator=EvaluatorSpec(name=evaluator) if evaluator else None)
    return TaskAccepted(task_id=task_id, request=request, session_ids=[f"{task_id}-s{i}" for i in range(n)])


def trajectory(session_id: str, task_id: str, status: SessionStatus = SessionStatus.COMPLETED,
               failure: FailureKind | None = None, versions: tuple[int, int] | None = None) -> Trajectory:
    return Trajectory(session_id=session_id, task_id=task_id, builder="per_request", session_status=status,
                      failure=failure, traces=[], policy_version="step-7",
                      policy_versions=PolicyRange(oldest=versions[0], newest=versions[1]) if versions else None)


def evaluation(session_id: str, task_id: str, reward: float, evaluator: str = "tests") -> Evaluation:
    return Evaluation(session_id=session_id, task_id=task_id, evaluator=evaluator, reward=reward,
                      passed=reward == 1.0)


async def test_groups_worker_end_to_end(kafka: KafkaSettings, tmp_path: Path) -> None:
    worker = groups_worker(kafka, tmp_path / "data", extra_env={
        "ROLLWIRE_GROUPS_GRACE_S": "0", "ROLLWIRE_GROUPS_MIN_FRACTION": "0.5"})
    worker.start()
    try:
        # A: all four in, rewards 1 0 0 1 (a session_completed evaluation too, which must not count).
        a = accepted("task-a", 4, timeout_s=600)
        # B: one scored, one policy timeout, one infrastructure failure: all in, no signal.
        b = accepted("task-b", 3, timeout_s=600)
        # C: three of four in by its deadline (3 s): emitted incomplete.  D: one of four: not emitted.
        c = accepted("task-c", 4, timeout_s=3)
        d = accepted("task-d", 4, timeout_s=3)
        facts = [
            evaluation("task-a-s0", "task-a", 1.0), evaluation("task-a-s1", "task-a", 0.0),
            evaluation("task-a-s1", "task-a", 1.0, evaluator="session_completed"),
            trajectory("task-b-s0", "task-b"), evaluation("task-b-s0", "task-b", 1.0),
            trajectory("task-b-s1", "task-b", SessionStatus.TIMEOUT, FailureKind.POLICY),
            trajectory("task-b-s2", "task-b", SessionStatus.ERROR, FailureKind.INFRASTRUCTURE),
            *[trajectory(f"task-c-s{i}", "task-c") for i in range(3)],
            *[evaluation(f"task-c-s{i}", "task-c", r) for i, r in enumerate([1.0, 0.0, 1.0])],
            trajectory("task-d-s0", "task-d"), evaluation("task-d-s0", "task-d", 1.0),
            trajectory("task-a-s0", "task-a", versions=(3, 3)), trajectory("task-a-s1", "task-a", versions=(2, 3)),
        ]
        async with EventProducer(kafka) as producer:
            await producer.send_many(facts)
            await producer.send_many([a, b])
            await producer.send_many([trajectory("task-a-s2", "task-a", versions=(4, 4)),
                                      trajectory("task-a-s3", "task-a"),
                                      evaluation("task-a-s2", "task-a", 0.0)])
            await producer.send_many([c, d])
            raw = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap)
            await raw.start()
            try:
                await raw.send_and_wait(kafka.registry().name(Topic.EVALUATIONS), b"[1, 2]", key=b"x")
            finally:
                await raw.stop()
            # A is not complete until its last evaluation arrives.
            await asyncio.sleep(1.0)
            await producer.send(evaluation("task-a-s3", "task-a", 1.0))
            events = await read_events(kafka, Topic.GROUPS, until=3, timeout_s=60)
            assert len(events) == 3, worker.log_tail()
            groups = {g.task_id: g for g in events if isinstance(g, Group)}
            assert set(groups) == {"task-a", "task-b", "task-c"}

            group_a = groups["task-a"]
            assert group_a.event_id == group_event_id("task-a")
            assert group_a.complete and not group_a.no_signal and group_a.evaluator == "tests"
            assert group_a.estimator == "grpo" and group_a.policy_version == "step-7"
            assert [s.session_id for s in group_a.samples] == a.session_ids
            assert [s.reward for s in group_a.samples] == [1.0, 0.0, 0.0, 1.0]
            assert [s.advantage for s in group_a.samples] == pytest.approx([0.866025, -0.866025, -0.866025,
                                                                             0.866025], abs=1e-5)
            assert all(s.trajectory_id for s in group_a.samples) and group_a.baseline_mean == 0.5
            # the range over its samples' trajectories (s3's has none).
            assert group_a.policy_versions == PolicyRange(oldest=2, newest=4)

            group_b = groups["task-b"]
            assert group_b.complete and group_b.no_signal and group_b.policy_versions is None
            assert [s.advantage for s in group_b.samples] == [0.0, 0.0, None]
            assert [s.in_baseline for s in group_b.samples] == [True, False, False]
            assert group_b.samples[2].failure is FailureKind.INFRASTRUCTURE

            group_c = groups["task-c"]
            assert not group_c.complete
            assert [s.reward for s in group_c.samples[:3]] == [1.0, 0.0, 1.0]
            assert group_c.samples[3].advantage is None and group_c.samples[3].failure is FailureKind.INFRASTRUCTURE
            assert group_c.baseline_mean == pytest.approx(2 / 3)

            # A late, redelivered fact of an emitted task emits nothing.
            await producer.send(evaluation("task-a-s0", "task-a", 0.0))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = worker.health() or {}
            if health.get("late", 0) >= 1 and health.get("dead_lettered", 0) >= 1:
                break
            await asyncio.sleep(0.3)
        assert health["late"] >= 1 and health["dead_lettered"] == 1, health
        assert health["emitted"] == 3 and health["incomplete"] == 1
        again = await read_events(kafka, Topic.GROUPS, until=4, timeout_s=3)
        assert sorted(g.task_id for g in again) == ["task-a", "task-b", "task-c"]  # D stays below its fraction
        letters = await read_events(kafka, Topic.DEAD_LETTER, until=1, timeout_s=10)
        assert len(letters) == 1 and isinstance(letters[0], DeadLetter)
        assert letters[0].source_topic.endswith("evaluations")
    finally:
        worker.stop()


async def test_a_killed_worker_resumes_from_its_table(kafka: KafkaSettings, tmp_path: Path) -> None:
    """Half a task's facts, SIGKILL, a restart on the same app id and data: the facts read before the crash
    must still count (table + changelog), and the task's group must come out once, with every sample."""
    # A short group session: the killed member's partitions go to the restarted one after 6 s, not 30.
    worker = groups_worker(kafka, tmp_path / "data", extra_env={"ROLLWIRE_GROUPS_GRACE_S": "0",
                                                               "ROLLWIRE_GROUPS_SESSION_TIMEOUT_S": "6"})
    worker.start()
    task = accepted("task-r", 4, timeout_s=600, evaluator=None)  # the worker's default: session_completed
    rewards = [1.0, 0.0, 1.0, 1.0]
    try:
        async with EventProducer(kafka) as producer:
            await producer.send(task)
            await producer.send_many([e for i in range(2) for e in (
                trajectory(f"task-r-s{i}", "task-r"),
                evaluation(f"task-r-s{i}", "task-r", rewards[i], evaluator="session_completed"))])
            deadline = time.monotonic() + 30
            while (worker.health() or {}).get("facts", 0) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.5)  # past the commit interval and the changelog flush
            assert worker.process is not None
            worker.process.kill()
            worker.process.wait(10)
            restarted = groups_worker(kafka, worker.data_dir, extra_env=worker.extra_env, app_id=worker.app_id)
            restarted.start(timeout_s=120)
            try:
                await producer.send_many([e for i in range(2, 4) for e in (
                    trajectory(f"task-r-s{i}", "task-r"),
                    evaluation(f"task-r-s{i}", "task-r", rewards[i], evaluator="session_completed"))])
                assert await read_events(kafka, Topic.GROUPS, until=1, timeout_s=60), restarted.log_tail()
                events = await read_events(kafka, Topic.GROUPS, until=2, timeout_s=3)
            finally:
                restarted.stop()
    finally:
        worker.stop()
    assert len(events) == 1, events  # read_events drops repeated event ids: one group, whatever was re-sent
    group = events[0]
    assert isinstance(group, Group) and group.complete and group.evaluator == "session_completed"
    assert [s.reward for s in group.samples] == rewards
    # rewards 1 0 1 1: mean 0.75, sample std 0.5 -> 0.5, -1.5, 0.5, 0.5
    assert [s.advantage for s in group.samples] == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-5)
