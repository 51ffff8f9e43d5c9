"""A proxy stopped while calls are in flight: after its shutdown grace it cuts them, and each is on the log
once, as ``proxy_stopped`` (not as a harness that hung up), before the producer closes (proxy/server.py,
CallService.drain)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from proxy.app import create_app
from proxy.server import proxy_server
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import free_port, serve

MESSAGES = [{"role": "user", "content": "hi"}]
GRACE_S = 1
TOKENS, TOKEN_INTERVAL_S = 24, 0.4  # the engine would take about 10 s for a whole reply


async def _call(client: httpx.AsyncClient, url: str, headers: dict[str, str], stream: bool,
                seen: asyncio.Event) -> str:
    """The call's outcome as the harness sees it: its status, or the transport error that ended it."""
    try:
        async with client.stream("POST", url, json={"messages": MESSAGES, "stream": stream},
                                 headers=headers) as response:
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                seen.set()
            return f"status {response.status_code} {body[:300]!r}"
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def test_calls_cut_by_a_shutdown_are_recorded_once_as_proxy_stopped(kafka: KafkaSettings) -> None:
    engine = create_standin(StandinConfig(latency_ms=100, reply_tokens=TOKENS,
                                          token_interval_ms=TOKEN_INTERVAL_S * 1000))
    with serve(engine) as engine_url, contextlib.ExitStack() as stack:
        app = create_app(proxy_settings(engine_url), kafka)
        url = stack.enter_context(serve(app, server=proxy_server(app, "127.0.0.1", free_port(), GRACE_S)))
        proxy = ProxyUnderTest(url, kafka)
        streamed_session, whole_session = proxy.new_session(), proxy.new_session()
        streaming, waiting = asyncio.Event(), asyncio.Event()
        async with httpx.AsyncClient(timeout=30) as client:
            calls = [asyncio.create_task(_call(client, f"{session['base_urls']['openai']}/chat/completions",
                                               auth(session), stream, seen))
                     for session, stream, seen in [(streamed_session, True, streaming),
                                                   (whole_session, False, waiting)]]
            await asyncio.wait_for(streaming.wait(), 10)  # the stream is under way, the whole call waits
            started = time.monotonic()
            await asyncio.to_thread(stack.close)  # SIGTERM's path: grace, cut, lifespan shutdown
            stopped_s = time.monotonic() - started
            outcomes = await asyncio.gather(*calls)
        assert stopped_s < TOKENS * TOKEN_INTERVAL_S / 2, stopped_s  # cut after the grace, not run out
        assert "status 200" not in outcomes[1:], outcomes  # the whole call never got a reply
        events = await proxy.completions(2, raw=True)
        by_session = {event.session_id: event for event in events}
        assert set(by_session) == {streamed_session["session_id"], whole_session["session_id"]}, events
        for event in events:
            assert event.status == "error" and event.error is not None, event
            assert event.error.kind == "proxy_stopped", event.error
        # The tokens the harness was sent before the cut are kept with the streamed call.
        assert by_session[streamed_session["session_id"]].token_ids, by_session
        assert not by_session[whole_session["session_id"]].token_ids
        await asyncio.sleep(1.0)
        assert len(await proxy.completions(2, raw=True)) == 2  # and nothing more
