"""Session builds (processors.trajectories.session_builds) and build processes (processors.trajectories.build_processes).

The build validates every stored record, resolves prompt deltas and runs the builder; what it cannot use
comes back as rejected calls with the dead letter's error type, and the trajectory names them. Real build
processes give the same trajectories as a build in place, hold back their callers when full; a process
that dies fails the jobs it held, and the next jobs run on a fresh one; a process whose worker is gone
(its stdin closed) exits.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from processors.builders import SessionFacts
from processors.trajectories.open_sessions import CallRef
from processors.trajectories.build_processes import PooledBuilds
from processors.trajectories.session_builds import BuildJob, BuildResult, InlineBuilds, build_session
from schemas.codec import decode_event, encode_event
from schemas.prompt_chain import is_delta, write_session
from schemas.topics import Topic, TopicRegistry
from schemas.trajectories import Trajectory
from tests.processors.worker_process import expected
from tests.processors.worker_process import SessionPlan, linear_session

REGISTRY = TopicRegistry("u.", 4, 2)


def _job(plan: SessionPlan, values: list[bytes] | None = None, **changes: Any) -> BuildJob:
    end = plan.end
    facts = SessionFacts(session_id=plan.session_id, task_id=plan.spec.task_id,
                         policy_version=plan.spec.policy_version, status=end.status if end else None,
                         failure=end.failure if end else None, ended_at=end.occurred_at if end else None)
    values = values if values is not None else [encode_event(c) for c in plan.completions]
    job = BuildJob(plan.session_id, 1, plan.spec.builder, facts,
                   [(CallRef(1, 10 + i), value) for i, value in enumerate(values)], "tests")
    return BuildJob(**{**{f: getattr(job, f) for f in BuildJob.__slots__}, **changes})


def _trajectory(result: BuildResult) -> Trajectory:
    trajectory = decode_event(result.trajectory.value, REGISTRY.spec(Topic.TRAJECTORIES))
    assert isinstance(trajectory, Trajectory)
    return trajectory


def test_a_build_is_the_builders_trajectory_encoded_and_stamped() -> None:
    plan = linear_session("sb1", turns=5, seed=3)
    result = build_session(_job(plan))
    trajectory = _trajectory(result)
    want = expected(plan)
    assert (result.trajectory.session_id, result.trajectory.event_id) == (plan.session_id, want.event_id)
    assert result.trajectory.key == plan.session_id.encode()
    assert trajectory.source == "tests" and trajectory.emitted_at is not None
    assert [t.token_ids.tolist() for t in trajectory.traces] == [t.token_ids.tolist() for t in want.traces]
    assert result.rejected == [] and result.unresolved == 0


def test_deltas_resolve_to_the_same_trajectory_as_full_events() -> None:
    plan = linear_session("sb2", turns=6, seed=4)
    written = write_session(plan.completions)
    assert any(is_delta(c) for c in written)
    full, delta = build_session(_job(plan)), build_session(_job(plan, [encode_event(c) for c in written]))
    assert delta.trajectory.event_id == full.trajectory.event_id
    assert _trajectory(delta).traces == _trajectory(full).traces


def test_bad_records_and_orphaned_deltas_are_rejected_and_named() -> None:
    """A record that is not JSON, one of another session, and the deltas resting on a rejected call."""
    plan = linear_session("sb3", turns=5, seed=5)
    written = [encode_event(c) for c in write_session(plan.completions)]
    stranger = encode_event(linear_session("other", turns=1, seed=6).completions[0])
    values = [written[0], b"{not json", *written[2:], stranger]
    result = build_session(_job(plan, values))
    kinds = {r.ref.offset: r.error_type for r in result.rejected}
    assert kinds[11] == "invalid_json"
    assert kinds[10 + len(values) - 1] == "key_mismatch"
    # Calls 2.. chain back through the broken call 1: each is left out, never built from a guess.
    orphans = [offset for offset, kind in kinds.items() if kind == "missing_prompt_parent"]
    assert orphans and result.unresolved == len(orphans)
    trajectory = _trajectory(result)
    built_calls = {cid for trace in trajectory.traces for cid in trace.completion_ids}
    assert built_calls == {plan.completions[0].event_id}
    assert sum("missing_prompt_parent" in p for p in trajectory.stats.problems) == len(orphans)


class _KillsItsProcess:
    """Unpickled in a pool process, it ends that process on the spot (a crashed build)."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return os._exit, (3,)


async def _run(builds: InlineBuilds | PooledBuilds, jobs: list[BuildJob]) -> tuple[dict[str, bytes], list[str]]:
    built: dict[str, bytes] = {}
    failed: list[str] = []
    done = asyncio.Event()

    async def on_built(job: BuildJob, result: BuildResult) -> None:
        built[job.session_id] = result.trajectory.value
        if len(built) + len(failed) == len(jobs):
            done.set()

    async def on_failed(job: BuildJob, exc: BaseException) -> None:
        failed.append(job.session_id)
        if len(built) + len(failed) == len(jobs):
            done.set()

    for job in jobs:
        await builds.submit(job, on_built, on_failed)
    await asyncio.wait_for(done.wait(), 120)
    return built, failed


def _stable(value: bytes) -> Trajectory:
    """The trajectory without its emission stamp (which differs between two builds)."""
    trajectory = decode_event(value, REGISTRY.spec(Topic.TRAJECTORIES))
    assert isinstance(trajectory, Trajectory)
    return trajectory.model_copy(update={"emitted_at": None})


@pytest.mark.timeout(180)
async def test_a_pool_builds_what_a_build_in_place_builds_and_survives_a_dead_process() -> None:
    plans = [linear_session(f"sp{i}", turns=3 + i % 3, seed=40 + i) for i in range(6)]
    jobs = [_job(plan) for plan in plans]
    inline, _ = await _run(InlineBuilds(), jobs)
    pool = PooledBuilds(1, max_in_flight=2)
    await pool.start()
    try:
        pooled, failed = await _run(pool, jobs)
        assert failed == []
        assert {sid: _stable(v) for sid, v in pooled.items()} == {sid: _stable(v) for sid, v in inline.items()}
        # A job that kills its process: reported as failed, the jobs after it built on a fresh process.
        first = pool.processes[0]
        crash = _job(plans[0], session_id="crash", facts=_KillsItsProcess())
        built, failed = await _run(pool, [crash, *jobs[:2]])
        assert "crash" in failed and not first.alive
        retry, failed = await _run(pool, jobs[:3])
        assert failed == [] and set(retry) == {p.session_id for p in plans[:3]}
        assert pool.processes[0] is not first and pool.processes[0].alive
    finally:
        await pool.close()


async def test_a_full_pool_holds_its_callers_back() -> None:
    """With room for one job, a second submit waits until the first is done."""
    plans = [linear_session(f"sq{i}", turns=2, seed=60 + i) for i in range(2)]
    pool = PooledBuilds(1, max_in_flight=1)
    await pool.start()
    finished: list[str] = []

    async def on_built(job: BuildJob, result: BuildResult) -> None:
        finished.append(job.session_id)

    async def on_failed(job: BuildJob, exc: BaseException) -> None:
        raise AssertionError(exc)

    try:
        await pool.submit(_job(plans[0]), on_built, on_failed)
        second = asyncio.ensure_future(pool.submit(_job(plans[1]), on_built, on_failed))
        await asyncio.sleep(0)
        assert not second.done()  # waiting for room: the first job is still being built
        await asyncio.wait_for(second, 60)  # taken once the first is done
        for _ in range(600):
            if len(finished) == 2:
                break
            await asyncio.sleep(0.05)
        assert finished == ["sq0", "sq1"]
    finally:
        await pool.close()


async def test_a_build_process_exits_when_its_input_closes() -> None:
    """What happens when the worker is gone, however it went: the child's stdin closes and it exits."""
    pool = PooledBuilds(1)
    await pool.start()
    child = pool.processes[0].process
    assert child is not None and child.returncode is None and child.stdin is not None
    child.stdin.close()
    assert await asyncio.wait_for(child.wait(), 30) == 0
    await pool.close()
