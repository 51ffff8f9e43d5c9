"""The workers' Faust consumer hands a fetched record to the streams in place, with Faust's semantics kept.

``EagerConsumer.wait_first`` is what Faust's fetch loop calls for every record: ``wait_first(hand_over,
suspend_flow.wait())``. These drive it directly, on a consumer of a real worker app (nothing is connected):
a hand-over that finishes at once runs in place (no task), one that has to wait goes on as a task and is
cut short by a rebalance as Faust's own race does, and its errors and return values come through.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import AsyncIterator

import pytest

from processors.worker.faust_worker import EagerConsumer, _continued, worker_app


@pytest.fixture
async def consumer() -> AsyncIterator[EagerConsumer]:
    app = worker_app("rollwire-test-eager", broker="kafka://127.0.0.1:1", web_enabled=False)
    consumer = app.consumer
    assert isinstance(consumer, EagerConsumer)
    yield consumer


async def test_a_hand_over_that_does_not_wait_runs_in_place_without_a_task(consumer: EagerConsumer) -> None:
    ran_in: list[asyncio.Task | None] = []

    async def hand_over() -> str:
        ran_in.append(asyncio.current_task())
        return "handed"

    tasks_before = len(asyncio.all_tasks())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the unused suspend_flow.wait() must be closed, not left un-awaited
        result = await consumer.wait_first(hand_over(), consumer.suspend_flow.wait())
        gc.collect()
    assert ran_in == [asyncio.current_task()]  # in the caller's task: none was created
    assert result.done and result.results == ["handed"] and not result.stopped
    assert len(asyncio.all_tasks()) == tasks_before


async def test_a_hand_over_that_waits_goes_on_and_finishes(consumer: EagerConsumer) -> None:
    room = asyncio.Event()
    steps: list[str] = []

    async def hand_over() -> int:
        steps.append("started")
        await room.wait()  # a stream's buffer is full
        steps.append("handed")
        return 7

    waiting = asyncio.ensure_future(consumer.wait_first(hand_over(), consumer.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    assert steps == ["started"] and not waiting.done()
    room.set()
    result = await asyncio.wait_for(waiting, 1)
    assert steps == ["started", "handed"]
    assert result.results == [7] and not result.stopped


async def test_a_rebalance_cuts_a_waiting_hand_over_short(consumer: EagerConsumer) -> None:
    """As in Faust's race: the flow is suspended (partitions revoked) while the record waits for room; the
    hand-over is cancelled (its cleanup runs) and the fetch loop goes on."""
    cleaned: list[str] = []

    async def hand_over() -> None:
        try:
            await asyncio.Event().wait()  # never gets room
        finally:
            cleaned.append("cancelled")

    waiting = asyncio.ensure_future(consumer.wait_first(hand_over(), consumer.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    consumer.suspend_flow.set()
    result = await asyncio.wait_for(waiting, 1)
    await asyncio.sleep(0)  # the cancelled hand-over's task runs its cleanup
    assert [winner.__qualname__ for winner in result.done] == ["Event.wait"]  # the flow's wait, not the hand-over
    assert cleaned == ["cancelled"]


async def test_an_error_in_the_hand_over_comes_through_in_place_or_after_a_wait(consumer: EagerConsumer) -> None:
    async def at_once() -> None:
        raise ValueError("refused at once")

    with pytest.raises(ValueError, match="refused at once"):
        await consumer.wait_first(at_once(), consumer.suspend_flow.wait())

    async def later() -> None:
        await asyncio.sleep(0.001)
        raise ValueError("refused later")

    with pytest.raises(ValueError, match="refused later"):
        await consumer.wait_first(later(), consumer.suspend_flow.wait())


async def test_with_the_flow_suspended_it_is_fausts_race_as_before(consumer: EagerConsumer) -> None:
    async def hand_over() -> None:
        await asyncio.sleep(0.01)

    consumer.suspend_flow.set()
    result = await consumer.wait_first(hand_over(), consumer.suspend_flow.wait())
    # Not handed over in place while suspended: the race ran, and the flow's wait won it.
    assert "Event.wait" in [winner.__qualname__ for winner in result.done]


async def test_a_resumed_coroutine_gets_the_values_and_the_cancellation_its_own_task_would() -> None:
    """The continuation (_continued) of a coroutine started by hand: a future's result goes in, a
    cancellation thrown at the await reaches the coroutine, which may still await in its cleanup."""
    loop = asyncio.get_running_loop()
    first: asyncio.Future[int] = loop.create_future()
    seen: list[object] = []

    async def body() -> int:
        value = await first
        seen.append(value)
        await asyncio.sleep(0)
        return value * 2

    coroutine = body()
    waiting_on = coroutine.send(None)
    assert waiting_on is first
    task = asyncio.ensure_future(_continued(coroutine, waiting_on))
    await asyncio.sleep(0)
    first.set_result(21)
    assert await asyncio.wait_for(task, 1) == 42
    assert seen == [21]

    blocker: asyncio.Future[None] = loop.create_future()

    async def cleans_up() -> None:
        try:
            await blocker
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0)  # an await during the cleanup
            seen.append("cleaned")
            raise

    coroutine2 = cleans_up()
    task = asyncio.ensure_future(_continued(coroutine2, coroutine2.send(None)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen[-2:] == ["cancelled", "cleaned"]
    assert blocker.cancelled()
