"""Several proxy processes on one log: any of them continues any session exactly, numbers stay unique.

Each proxy here is its own app and event loop on its own port (as separate processes are), sharing only
Kafka and the engine: the stand-in with vLLM's token endpoints, so calls continue exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve
from tests.support.standin_engine import StandinConfig, create_app as create_standin

pytestmark = pytest.mark.kafka

SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture
def engine_url() -> Iterator[str]:
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=12, token_api=True))) as url:
        yield url


@contextlib.contextmanager
def tier(kafka: KafkaSettings, engine_url: str, count: int, **overrides: Any) -> Iterator[list[ProxyUnderTest]]:
    with contextlib.ExitStack() as stack:
        proxies = [ProxyUnderTest(stack.enter_context(serve(create_app(
            proxy_settings(engine_url, proxy_instance=f"proxy-{i}", **overrides), kafka))), kafka)
            for i in range(count)]
        yield proxies


def ask(url: str, session: dict, messages: list[dict[str, Any]], *, stream: bool = False,
        headers: dict[str, str] | None = None) -> str:
    """One chat call on ``url`` (a proxy of the tier) for ``session``, by its key; the reply's text."""
    response = httpx.post(f"{url}/v1/chat/completions", headers={**auth(session), **(headers or {})}, timeout=30,
                          json={"model": "m", "messages": messages, "stream": stream, "max_tokens": 12})
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text


def extends(child: Completion, parent: Completion) -> bool:
    whole = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()
    return child.prompt_token_ids.tolist()[:len(whole)] == whole


def of_session(events: list[Completion], session_id: str) -> list[Completion]:
    return [e for e in events if e.session_id == session_id]


async def test_two_processes_alternating_continue_one_branch_exactly(kafka: KafkaSettings, engine_url: str) -> None:
    """No affinity at all: the calls of one session go to two processes in turn. Every call after the first
    continues the one branch exactly (its prompt extends its parent's prompt + sampled ids), numbers run
    0..n-1 in order whichever process gave them, and each event names the process that served it."""
    with tier(kafka, engine_url, 2) as (a, b):
        session = a.new_session(engine={"max_tokens": 12})
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "start"}]
        for turn in range(6):
            url = (a, b)[turn % 2].url
            text = ask(url, session, messages, stream=turn % 3 == 1)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"next {turn}"}]
        events = of_session(await a.completions(6), session["session_id"])
    assert [e.sequence for e in events] == list(range(6))
    assert [e.proxy for e in events] == ["proxy-0", "proxy-1"] * 3
    assert all(e.status == "ok" for e in events)
    assert {e.continuation.branch for e in events} == {"b0"}
    for parent, child in zip(events, events[1:]):
        assert child.continuation.mode == "exact", (child.sequence, child.continuation)
        assert child.continuation.parent_sequence == parent.sequence
        assert extends(child, parent)
    # The deltas written by one process name events the other wrote: still one chain.
    assert all(e.prompt_token_ids is not None for e in events)


async def test_a_restarted_process_continues_from_the_log(kafka: KafkaSettings, engine_url: str) -> None:
    """A proxy serves three calls and is stopped; a new one (nothing in memory) serves the fourth: exact,
    numbered 3 (not 0 again), the restore counted in its metrics."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "start"}]
    with tier(kafka, engine_url, 1) as (first,):
        session = first.new_session(engine={"max_tokens": 12})
        for turn in range(3):
            text = ask(first.url, session, messages)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"next {turn}"}]
    with tier(kafka, engine_url, 1) as (again,):
        ask(again.url, session, messages)
        metrics = httpx.get(f"{again.url}/metrics", timeout=10).text
        events = of_session(await again.completions(4), session["session_id"])
    assert [e.sequence for e in events] == [0, 1, 2, 3]
    last = events[-1]
    assert last.continuation.mode == "exact" and last.continuation.parent_sequence == 2
    assert extends(last, events[2])
    assert 'rollwire_proxy_restore_seconds_count{outcome="ok"} 1.0' in metrics
    restore = last.continuation.restore
    assert restore is not None and restore.replayed == 3 and restore.bytes_read > 0
    assert all(e.continuation.restore is None for e in events[:3])


async def test_concurrent_calls_on_two_processes_get_unique_numbers(kafka: KafkaSettings, engine_url: str) -> None:
    """Sixteen calls of one session at once, half on each process: the log orders their claims, so the
    numbers are 0..15 with none twice, and every branch opened is named after its own call."""
    with tier(kafka, engine_url, 2) as (a, b):
        session = a.new_session(engine={"max_tokens": 12})

        def one(i: int) -> str:
            return ask((a, b)[i % 2].url, session, [SYSTEM, {"role": "user", "content": f"question {i}"}])

        await asyncio.gather(*(asyncio.to_thread(one, i) for i in range(16)))
        events = of_session(await a.completions(16), session["session_id"])
    assert sorted(e.sequence for e in events) == list(range(16))
    branches = [e.continuation.branch for e in events]
    assert len(set(branches)) == 16 and all(b == f"b{e.sequence}" for b, e in zip(branches, events))


async def test_an_sdk_retry_on_another_process_is_a_retry(kafka: KafkaSettings, engine_url: str) -> None:
    """The SDK's retry of a call (same body, retry counter 1) reaches the other process: it is numbered as a
    retry of the first call (the claims carry the body's digest) and continues as a retry of its branch."""
    with tier(kafka, engine_url, 2) as (a, b):
        session = a.new_session(engine={"max_tokens": 12})
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "start"}]
        text = ask(a.url, session, messages)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        ask(a.url, session, messages)
        ask(b.url, session, messages, headers={"x-stainless-retry-count": "1"})
        first, second, retried = of_session(await a.completions(3), session["session_id"])
    assert retried.sequence == 2 and retried.retry_of == 1
    assert retried.continuation.mode == "exact" and retried.continuation.retry_of_sequence == 1
    assert retried.prompt_token_ids.tolist() == second.prompt_token_ids.tolist()


async def test_a_log_that_cannot_be_read_in_time_renders_the_call(kafka: KafkaSettings, engine_url: str) -> None:
    """A process whose read of the session's log times out serves the call anyway: rendered whole, its event
    saying why, never a failed call."""
    with tier(kafka, engine_url, 1) as (a,), tier(kafka, engine_url, 1, restore_timeout_s=1e-6) as (slow,):
        session = a.new_session(engine={"max_tokens": 12})
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "start"}]
        text = ask(a.url, session, messages)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
        ask(slow.url, session, messages)
        first, second = of_session(await a.completions(2), session["session_id"])
    assert second.status == "ok" and second.sequence == 1
    assert second.continuation.mode == "rendered" and second.continuation.opened == "restore_timed_out"


@contextlib.contextmanager
def claims_held(app: Any) -> Iterator[Callable[[], None]]:
    """Hold back what a running proxy's claims reader takes in (in order, nothing dropped) until the function
    yielded is called: the proxy then knows of no claim made meanwhile, its own included, as if its reader
    were slow. The calls it receives meanwhile are placed before their numbers are in."""
    numbers = app.state.proxy.numbers
    take = numbers._take
    held: list[Any] = []
    loops: list[asyncio.AbstractEventLoop] = []
    holding = True

    def deferred(received: Any) -> None:
        if not holding:
            take(received)
            return
        held.append(received)
        if not loops:
            loops.append(asyncio.get_running_loop())

    def let_go() -> None:
        nonlocal holding
        holding = False
        for received in held:
            take(received)
        held.clear()

    def release() -> None:
        if loops:
            loops[0].call_soon_threadsafe(let_go)
        else:
            let_go()

    numbers._take = deferred
    try:
        yield release
    finally:
        release()
        numbers._take = take


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_placed_before_its_number_is_placed_again_when_the_log_moved(
        kafka: KafkaSettings, engine_url: str, stream: bool) -> None:
    """A process places a call and sends it to the engine while the call's claim is still coming back. Here
    its claims reader is held, so it does not know yet that the other process served the session's first
    call: it places the second call as a new branch on its empty branches. When the claims come in, the call's
    number shows a call of another process before it: the session's log is read, the first engine request is
    dropped, and the call is placed again, continuing the first call's branch exactly. Nothing of the dropped
    request reached the harness: one answer, one event."""
    with serve(create_standin(StandinConfig(latency_ms=300, reply_tokens=12, token_api=True))) as slow_engine:
        first_app = create_app(proxy_settings(slow_engine, proxy_instance="proxy-0"), kafka)
        second_app = create_app(proxy_settings(slow_engine, proxy_instance="proxy-1"), kafka)
        with serve(first_app) as first_url, serve(second_app) as second_url:
            a = ProxyUnderTest(first_url, kafka)
            session = a.new_session(engine={"max_tokens": 12})
            messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "start"}]
            with claims_held(second_app) as release:
                text = ask(first_url, session, messages)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
                asked = asyncio.ensure_future(asyncio.to_thread(ask, second_url, session, messages, stream=stream))
                await asyncio.sleep(0.15)  # the call is on the engine (300 ms to its first bytes), unnumbered
                assert not asked.done()
                release()
                second_text = await asked
            metrics = httpx.get(f"{second_url}/metrics", timeout=10).text
            first, second = of_session(await a.completions(2), session["session_id"])
    assert second_text
    assert "rollwire_proxy_calls_placed_again_total 1.0" in metrics
    assert second.sequence == 1 and second.proxy == "proxy-1" and second.status == "ok"
    assert second.continuation.mode == "exact" and second.continuation.parent_sequence == 0
    assert second.continuation.branch == first.continuation.branch == "b0"
    assert second.continuation.restore is not None and second.continuation.restore.replayed == 1
    assert extends(second, first)
