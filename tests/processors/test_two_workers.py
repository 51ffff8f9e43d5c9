"""Two trajectory workers in one consumer group, the partitions shared, a rebalance in the middle of the stream.

Real broker, real worker processes (``python -m deploy.cli processors``), one app id (one
consumer group, one set of changelogs). Sessions stream in waves; a second worker joins while they flow
(the partitions are split between the two), later the first is stopped (its partitions move to the
second), and the stream goes on. Then:

- no completion is lost: every session has a trajectory, the one ``build_trajectory`` makes from all of
  its completions (same event id, same traces), never a partial one;
- no duplicate trajectory: a session is never built into two trajectories with different event ids or
  different content. A session built by the worker that owned it just before the rebalance and built
  again by its new owner (its acknowledgement had not been applied to the tables yet) is re-emitted with the same
  event id and the same content: that is the at-least-once contract (readers de-duplicate by event id:
  the typed consumer, the groups worker by session, the SFT store by ``<trajectory id>:<trace id>``),
  so it is allowed, counted and printed, never two different trajectories;
- both workers did work: the partitions were shared, then moved.

Around a rebalance Faust's stream skips records (flow-control queues cleared on resume, the fetch position
already past them) and hands others out twice; before processors.trajectories.continuity read the skipped ones back
from the log, about half of the runs built a session without some of its calls.

The completions are written as the proxy writes them: each continuing call a prompt delta on its parent
(schemas.prompt_chain), so a chain whose parent was read by one worker and whose child by the other is
resolved from the log after the move.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from schemas.prompt_chain import is_delta, write_session
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from tests.processors.worker_process import expected, same
from tests.processors.worker_process import SessionPlan, WorkerProcess, linear_session

pytestmark = pytest.mark.kafka

SESSIONS = 50
WAVES = 10  # sessions start in waves, so that some are mid-flight at the join and at the stop


async def _stream(kafka: KafkaSettings, plans: list[SessionPlan], pause_s: float, waves_sent: list[int]) -> None:
    async with EventProducer(kafka) as producer:
        per_wave = len(plans) // WAVES
        for wave in range(WAVES):
            group = plans[wave * per_wave:(wave + 1) * per_wave]
            await producer.send_many([p.spec for p in group])
            for turn in range(max(len(p.completions) for p in group)):
                await producer.send_many([p.completions[turn] for p in group if turn < len(p.completions)])
                await asyncio.sleep(pause_s)
            await producer.send_many([p.end for p in group if p.end is not None])
            waves_sent.append(wave)


async def _every_copy(kafka: KafkaSettings, sessions: int, timeout_s: float) -> list[Trajectory]:
    """Every trajectory record on the topic, duplicates included, once each session has one."""
    out: list[Trajectory] = []
    async with EventConsumer(kafka, [Topic.TRAJECTORIES], group_id=None, dead_letters=False,
                             dedupe_window=0) as consumer:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            for received in await consumer.getmany(timeout_ms=500):
                assert isinstance(received.event, Trajectory)
                out.append(received.event)
            if len({t.session_id for t in out}) >= sessions:
                # Let re-emissions still in flight arrive too.
                for _ in range(6):
                    out.extend(r.event for r in await consumer.getmany(timeout_ms=500)  # type: ignore[misc]
                               if isinstance(r.event, Trajectory))
                break
    return out


async def _health(worker: WorkerProcess, timeout_s: float = 60) -> dict:
    """The worker's counters, waiting out a rebalance (the page answers 503 until tables are recovered)."""
    for _ in range(int(timeout_s / 0.2)):
        health = await asyncio.to_thread(worker.health)
        if health is not None:
            return health
        await asyncio.sleep(0.2)
    raise AssertionError(f"worker not healthy:\n{worker.log_tail()}")


def _content(trajectory: Trajectory) -> dict:
    """What a trajectory says, without the stamps a re-emission changes (emitted_at, source)."""
    return trajectory.model_dump(mode="json", exclude={"emitted_at", "source"})


# The agent flushes its table writes every ``batch_records`` records (processors.trajectories.app flush) as well as on
# its timer; at 5 the agent's own flushes run across the join and the stop, not only the timer's.
@pytest.mark.parametrize("batch_records", ["1000", "5"])
async def test_two_workers_with_a_rebalance_mid_stream(kafka, tmp_path, batch_records: str) -> None:
    plans = [linear_session(f"r{i}", turns=3 + i % 5, seed=200 + i, branch_at=3 if i % 4 == 0 else None,
                            builder="per_request" if i % 6 == 0 else "prefix_merging") for i in range(SESSIONS)]
    # Written as the proxy writes them (deltas on their parents); expected() builds from the full ones.
    sent = [SessionPlan(p.spec, write_session(p.completions), p.end) for p in plans]
    assert sum(is_delta(c) for p in sent for c in p.completions) > SESSIONS
    app_id = f"processors-{uuid.uuid4().hex[:6]}"
    env = {"ROLLWIRE_PROCESSORS_IDLE_S": "600", "ROLLWIRE_PROCESSORS_SESSION_TIMEOUT_S": "6",
           "ROLLWIRE_PROCESSORS_CACHE_MB": "0",  # every payload read back from the log: the move's hard case
           "ROLLWIRE_PROCESSORS_BATCH_RECORDS": batch_records}
    first = WorkerProcess(kafka, tmp_path / "first", app_id=app_id, extra_env=env)
    second = WorkerProcess(kafka, tmp_path / "second", app_id=app_id, extra_env=env)
    first.start()
    waves_sent: list[int] = []
    try:
        async with asyncio.timeout(360):  # a hung rebalance fails the test, never stalls it
            stream = asyncio.create_task(_stream(kafka, sent, pause_s=0.3, waves_sent=waves_sent))
            while len(waves_sent) < 2:
                await asyncio.sleep(0.1)
            await asyncio.to_thread(second.start)  # joins the group while events flow: partitions split
            joined_at = len(waves_sent)
            while len(waves_sent) < joined_at + 2:
                await asyncio.sleep(0.1)
            both = [await _health(first), await _health(second)]
            await asyncio.to_thread(first.stop)  # leaves the group mid-stream: its partitions move
            stopped_at = len(waves_sent)
            await stream
            assert stopped_at < WAVES, "the stop must happen while events still flow"
            copies = await _every_copy(kafka, SESSIONS, timeout_s=120)
            last = await _health(second)
    finally:
        first.stop()
        second.stop()
    by_session: dict[str, list[Trajectory]] = {}
    for trajectory in copies:
        by_session.setdefault(trajectory.session_id, []).append(trajectory)
    missing = sorted({p.session_id for p in plans} - set(by_session))
    assert not missing, f"no trajectory for {missing}\n{first.log_tail()}\n{second.log_tail()}"
    reemitted = 0
    for plan in plans:
        got = by_session[plan.session_id]
        want = expected(plan)
        assert {t.event_id for t in got} == {want.event_id}, \
            (plan.session_id, [(t.partial, t.stats.completions, t.stats.problems) for t in got], want.stats.completions)
        same(got[0], want)
        assert not got[0].partial and not got[0].stats.problems
        assert all(_content(t) == _content(got[0]) for t in got[1:]), f"{plan.session_id}: copies differ"
        reemitted += len(got) - 1
    print(f"sessions={SESSIONS} trajectory_records={len(copies)} reemitted_same_id={reemitted}")
    # Both members held partitions while both ran (each had read records), and after the stop the second
    # built what was left.
    assert all(h["records"] > 0 for h in both), both
    assert last["trajectories"] > both[1]["trajectories"]
    assert last["dead_lettered"] == 0 and last["unresolved"] == 0
