"""Deferred work: jobs run in the order queued, one per turn of the loop, with the loop's other work
between them, and one job's failure does not stop the ones after it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.deferred import DeferredWork


async def test_jobs_run_in_order_one_per_turn_of_the_loop() -> None:
    deferred = DeferredWork()
    ran: list[str] = []
    for name in ("a", "b", "c"):
        deferred.add(lambda name=name: ran.append(name))
    assert ran == [] and len(deferred) == 3  # nothing runs at once: the caller's own work goes first
    await asyncio.sleep(0)  # one turn: one job
    assert ran == ["a"]
    # Work that comes in meanwhile (here: a callback) runs between the jobs, not after all of them.
    asyncio.get_running_loop().call_soon(lambda: ran.append("other"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert ran.index("other") < ran.index("c")
    assert sorted(ran) == ["a", "b", "c", "other"] and len(deferred) == 0
    deferred.add(lambda: ran.append("d"))  # an idle queue starts again
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert ran[-1] == "d"


async def test_a_failing_job_is_logged_and_the_rest_still_run(caplog: pytest.LogCaptureFixture) -> None:
    deferred = DeferredWork()
    ran: list[int] = []

    def fail() -> None:
        raise ValueError("broken job")

    deferred.add(fail)
    deferred.add(lambda: ran.append(1))
    with caplog.at_level(logging.ERROR, logger="proxy.deferred"):
        for _ in range(3):
            await asyncio.sleep(0)
    assert ran == [1]
    assert "broken job" in caplog.text
