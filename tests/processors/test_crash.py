"""Crash-proof: SIGKILL the worker while sessions stream in, restart it, lose and invent nothing.

The worker is killed twice mid-stream (no flush, no commit) and restarted on the same
data dir and app id. Reading the trajectories topic and dropping duplicates by event id, every session
must have exactly the trajectory of a fault-free run (``build_trajectory`` on its events, which
test_worker shows the worker matches), none missing, no partial or extra ones.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas.topics import Topic
from schemas.transport import EventProducer
from tests.processors.worker_process import expected
from tests.processors.worker_process import WorkerProcess, by_session, linear_session, read_events

pytestmark = pytest.mark.kafka

SESSIONS = 60
WAVES = 6  # sessions start in waves, so that some are mid-flight at every kill


async def _stream(kafka, plans, pause_s: float) -> None:
    async with EventProducer(kafka) as producer:
        per_wave = len(plans) // WAVES
        for wave in range(WAVES):
            group = plans[wave * per_wave:(wave + 1) * per_wave]
            await producer.send_many([p.spec for p in group])
            for turn in range(max(len(p.completions) for p in group)):
                await producer.send_many([p.completions[turn] for p in group if turn < len(p.completions)])
                await asyncio.sleep(pause_s)
            await producer.send_many([p.end for p in group if p.end is not None])


async def test_sigkill_mid_stream_loses_nothing(kafka, tmp_path) -> None:
    plans = [linear_session(f"c{i}", turns=3 + i % 5, seed=i, branch_at=3 if i % 4 == 0 else None,
                            builder="per_request" if i % 5 == 0 else "prefix_merging") for i in range(SESSIONS)]
    worker = WorkerProcess(kafka, tmp_path / "data", extra_env={"ROLLWIRE_PROCESSORS_IDLE_S": "600",
                                                                    "ROLLWIRE_PROCESSORS_SESSION_TIMEOUT_S": "6"})
    worker.start()
    try:
        stream = asyncio.create_task(_stream(kafka, plans, pause_s=0.25))
        for delay in (3.0, 4.0):
            await asyncio.sleep(delay)
            worker.kill()
            await asyncio.sleep(0.5)
            worker.start()
        await stream
        events = await read_events(kafka, Topic.TRAJECTORIES, until=SESSIONS, timeout_s=90)
        grouped = by_session(events)
        print(f"distinct_trajectories={len(events)}")
        missing = sorted({p.session_id for p in plans} - set(grouped))
        assert not missing, f"no trajectory for {missing}\n{worker.log_tail()}"
        for plan in plans:
            distinct = {t.event_id: t for t in grouped[plan.session_id]}
            want = expected(plan)
            assert list(distinct) == [want.event_id], plan.session_id
            assert not distinct[want.event_id].partial
    finally:
        worker.stop()
