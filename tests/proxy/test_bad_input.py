"""Bad input and failing parts: every case gets an OpenAI-shaped error (never a traceback), and a
failed call of a known session is still recorded with its reason."""

from __future__ import annotations

import httpx
import pytest

from proxy.app import create_app
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import free_port, serve

pytestmark = pytest.mark.kafka

MESSAGES = [{"role": "user", "content": "hi"}]


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize("content, headers, status, fragment", [
    (b"{not json", {"content-type": "application/json"}, 400, "not valid JSON"),
    (b'{"messages": []}', {"content-type": "text/plain"}, 415, "application/json"),
    (b'{"model": "m"}', {"content-type": "application/json"}, 400, "messages"),
    (b'{"messages": []}', {"content-type": "application/json"}, 400, "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', {"content-type": "application/json"}, 400, "role"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', {"content-type": "application/json"}, 400, "n=1"),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', {"content-type": "application/json"}, 400, "tool_call_id"),
    (b'[1, 2]', {"content-type": "application/json"}, 400, "JSON object"),
])
def test_malformed_requests(proxy: ProxyUnderTest, content: bytes, headers: dict, status: int, fragment: str) -> None:
    session = proxy.new_session()
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", content=content,
                          headers={**headers, **auth(session)})
    assert fragment in openai_error(response, status)["message"]


def test_body_over_the_limit_is_413(kafka: KafkaSettings, standin_url: str) -> None:
    with serve(create_app(proxy_settings(standin_url, proxy_max_body_bytes=4096), kafka)) as url:
        session = ProxyUnderTest(url, kafka).new_session()
        big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
        response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", json=big, headers=auth(session))
        assert "limit" in openai_error(response, 413)["message"]


@pytest.mark.parametrize("fail, status, kind", [
    ("overflow", 400, "context_overflow"),
    ("error", 502, "engine_error"),
])
async def test_engine_errors_are_shaped_and_recorded(proxy: ProxyUnderTest, fail: str, status: int, kind: str) -> None:
    session = proxy.new_session(engine={"extra": {"standin_fail": fail}})
    for stream in (False, True):
        response = httpx.post(f"{session['base_urls']['openai']}/chat/completions",
                              json={"messages": MESSAGES, "stream": stream}, timeout=30, headers=auth(session))
        error = openai_error(response, status)
        if kind == "context_overflow":
            assert error["code"] == "context_length_exceeded" and "context" in error["message"]
    events = await proxy.completions(2)
    assert [e.status for e in events] == ["error", "error"]
    assert {e.error.kind for e in events} == {kind}
    assert all(e.error.http_status == status for e in events)


async def test_engine_timeout_is_504_and_recorded(kafka: KafkaSettings, standin_url: str) -> None:
    with serve(create_app(proxy_settings(standin_url, engine_timeout_s=0.5), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session(engine={"extra": {"standin_fail": "hang"}})
        response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", json={"messages": MESSAGES},
                              timeout=30, headers=auth(session))
        assert openai_error(response, 504)["type"] == "server_error"
        [event] = await proxy.completions(1)
        assert event.error.kind == "engine_timeout"


async def test_engine_down_is_503_and_recorded(kafka: KafkaSettings) -> None:
    with serve(create_app(proxy_settings(f"http://127.0.0.1:{free_port()}", served_model="m"), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", json={"messages": MESSAGES},
                              headers=auth(session))
        assert "cannot be reached" in openai_error(response, 503)["message"]
        [event] = await proxy.completions(1)
        assert event.error.kind == "engine_unavailable" and event.prompt_token_ids is None


async def test_stream_broken_midway_ends_with_an_error_and_no_finish(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(engine={"extra": {"standin_fail": "cut"}})
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions",
                          json={"messages": MESSAGES, "stream": True}, timeout=30, headers=auth(session))
    assert response.status_code == 200  # the stream had started
    payloads = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in payloads and '"finish_reason":"' not in response.text
    assert '"error"' in payloads[-1]
    [event] = await proxy.completions(1)
    assert event.status == "error" and event.error.kind == "engine_error"
    assert event.token_ids is not None and len(event.token_ids) > 0  # the partial turn is kept


def test_metrics_count_requests_errors_and_events(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    url = f"{session['base_urls']['openai']}/chat/completions"
    httpx.post(url, json={"messages": MESSAGES}, headers=auth(session))
    httpx.post(url, json={"messages": []}, headers=auth(session))
    httpx.post(f"{proxy.url}/s/nobody/v1/chat/completions", json={"messages": MESSAGES}, headers=auth(session))
    text = httpx.get(f"{proxy.url}/metrics").text
    assert 'rollwire_proxy_requests_total{api="openai.chat",status="200"} 1.0' in text
    assert 'rollwire_proxy_requests_total{api="openai.chat",status="400"} 1.0' in text
    assert 'rollwire_proxy_errors_total{api="openai.chat",kind="unknown_session"} 1.0' in text
    assert 'rollwire_proxy_completion_events_total{status="ok"} 1.0' in text
    assert 'rollwire_proxy_completion_events_total{status="error"} 1.0' in text  # the refused call too
    assert 'rollwire_proxy_sessions{state="live"} 1.0' in text
    assert "rollwire_proxy_request_seconds_bucket" in text
