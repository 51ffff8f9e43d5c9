"""A harness that hangs up (its SDK's timeout) while its call waits for the engine: the wait is cut short
and the call recorded once, as abandoned, never as a turn the harness did not get (proxy/hangups.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from proxy.app import create_app
from proxy.errors import ClientDisconnected
from proxy.hangups import Hangup
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

MESSAGES = [{"role": "user", "content": "hi"}]
ENGINE_LATENCY_S = 4.0  # far longer than the client waits


@pytest.mark.parametrize("api", ["chat", "chat-stream", "anthropic", "anthropic-stream", "gemini"])
async def test_a_client_that_hangs_up_before_the_engine_answers_leaves_one_abandoned_call(
        kafka: KafkaSettings, api: str) -> None:
    slow = create_standin(StandinConfig(latency_ms=ENGINE_LATENCY_S * 1000, reply_tokens=8))
    with serve(slow) as slow_url, serve(create_app(proxy_settings(slow_url), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        stream = api.endswith("-stream")
        headers = auth(session)
        if api.startswith("chat"):
            target = f"{session['base_urls']['openai']}/chat/completions"
            body: dict = {"messages": MESSAGES, "stream": stream}
        elif api.startswith("anthropic"):
            target = f"{session['base_urls']['anthropic']}/v1/messages"
            body = {"model": "m", "max_tokens": 16, "messages": MESSAGES, "stream": stream}
            headers = {"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"}
        else:
            target = f"{session['base_urls']['gemini']}/v1beta/models/m:generateContent"
            body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
            headers = {"x-goog-api-key": session["api_key"]}
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.5)) as client:
            with pytest.raises(httpx.ReadTimeout):
                async with client.stream("POST", target, json=body, headers=headers) as response:
                    await response.aread()
        # Recorded as soon as the hang-up was seen, not once the engine would have answered.
        [event] = await proxy.completions(1, timeout_s=ENGINE_LATENCY_S - 1.0)
        assert time.monotonic() - started < ENGINE_LATENCY_S
        assert event.status == "error" and event.error is not None
        assert event.error.kind == "client_disconnected", event.error
        assert event.token_ids is None or len(event.token_ids) == 0
        # Past the time the engine would have answered: still that one event (no served turn after it).
        await asyncio.sleep(ENGINE_LATENCY_S - (time.monotonic() - started) + 0.5)
        assert len(await proxy.completions(1, raw=True)) == 1


async def test_a_client_that_stays_gets_its_reply_and_one_served_event(kafka: KafkaSettings) -> None:
    # The watcher must not mistake anything but a hang-up for one (the body is read, the reply comes).
    engine = create_standin(StandinConfig(latency_ms=300, reply_tokens=8))
    with serve(engine) as engine_url, serve(create_app(proxy_settings(engine_url), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        async with httpx.AsyncClient(timeout=30) as client:
            whole = await client.post(f"{session['base_urls']['openai']}/chat/completions",
                                      json={"messages": MESSAGES}, headers=auth(session))
            assert whole.status_code == 200, whole.text
            streamed = await client.post(f"{session['base_urls']['openai']}/chat/completions",
                                         json={"messages": MESSAGES, "stream": True}, headers=auth(session))
            assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        events = await proxy.completions(2)
        assert [e.status for e in events] == ["ok", "ok"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_hang_up_during_an_exact_continuation_leaves_one_abandoned_call(kafka: KafkaSettings,
                                                                                stream: bool) -> None:
    # A session's second call continues its branch through the engine's token endpoints (exact mode): its
    # stream is made from the whole turn, so the wait for the engine is inside the call, not the stream.
    slow = create_standin(StandinConfig(latency_ms=1, reply_tokens=12, token_interval_ms=350, token_api=True))
    with serve(slow) as slow_url, serve(create_app(proxy_settings(slow_url), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session(engine={"max_tokens": 12})
        target = f"{session['base_urls']['openai']}/chat/completions"
        messages: list[dict] = [{"role": "user", "content": "go"}]
        async with httpx.AsyncClient(timeout=30) as client:
            first = await client.post(target, json={"messages": messages}, headers=auth(session))
            assert first.status_code == 200, first.text
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "more"}]
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.5)) as client:
            with pytest.raises(httpx.ReadTimeout):
                async with client.stream("POST", target, json={"messages": messages, "stream": stream},
                                         headers=auth(session)) as response:
                    await response.aread()
        served, abandoned = await proxy.completions(2, timeout_s=3.5, raw=True)
        assert time.monotonic() - started < 4.0  # before the engine's 12 tokens 350 ms apart were done
        assert served.status == "ok" and served.continuation.mode == "rendered"
        assert (abandoned.sequence, abandoned.status) == (1, "error") and abandoned.error is not None
        assert abandoned.error.kind == "client_disconnected", abandoned.error
        await asyncio.sleep(4.5 - (time.monotonic() - started))
        assert len(await proxy.completions(2, raw=True)) == 2  # and never a served turn after it


async def test_a_guarded_wait_runs_in_the_calling_task_and_a_hang_up_ends_only_that_wait() -> None:
    """The guarded work runs in the call's own task (no task of its own to be scheduled first); a hang-up
    ends the wait with ClientDisconnected and leaves the call's task free to go on (to record the call);
    a cancellation from elsewhere (the server stopping) stays a cancellation."""
    messages: asyncio.Queue[dict] = asyncio.Queue()
    hangup = Hangup(messages.get)

    async def where() -> asyncio.Task | None:
        return asyncio.current_task()

    assert await hangup.guard(where(), "the engine") is asyncio.current_task()

    waiting = asyncio.Event()

    async def engine() -> None:
        waiting.set()
        await asyncio.sleep(3600)

    async def call() -> str:
        try:
            await hangup.guard(engine(), "the engine's first tokens")
        except ClientDisconnected as exc:
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
            await asyncio.sleep(0.01)  # the call goes on: its failure is recorded after this
            return exc.message
        return "served"

    stopped = asyncio.ensure_future(call())
    await waiting.wait()
    stopped.cancel()  # the server stopping: not a hang-up
    with pytest.raises(asyncio.CancelledError):
        await stopped

    waiting.clear()
    cut = asyncio.ensure_future(call())
    await waiting.wait()
    messages.put_nowait({"type": "http.disconnect"})
    assert "while the call waited for the engine's first tokens" in await asyncio.wait_for(cut, 5)
    waiting.clear()
    with pytest.raises(ClientDisconnected):  # gone before the wait: the work starts and is cut at its first wait
        await hangup.guard(engine(), "the policy gate")
    assert waiting.is_set()
