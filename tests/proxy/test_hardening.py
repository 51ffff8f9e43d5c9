"""Regression tests for the hardening issue's faults in the proxy's HTTP path, one or more per fault, named
after it: session isolation (1), deep JSON (3), bodies the record cannot hold (4), engine stream faults
(5), every call recorded (6), the key before the body and provider-shaped 404/405 (7).

Faults 2, 3 (provider parsing) and 8 (Gemini schemas, ``session new``) have their tests beside the
provider modules (``test_hardening_providers.py``, ``test_reasoning_codec.py``, ``test_session_cli.py``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from proxy.app import create_app
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

MESSAGES = [{"role": "user", "content": "hi"}]


def chat_url(session: dict) -> str:
    return f"{session['base_urls']['openai']}/chat/completions"


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


# -- fault 1: a path session checks the key ------------------------------------------------------------

async def test_fault1_sibling_key_on_path_is_refused_and_not_recorded(proxy: ProxyUnderTest) -> None:
    a, b = proxy.new_session(), proxy.new_session()
    body = {"messages": MESSAGES, "max_tokens": 4}
    with_a_key = httpx.post(chat_url(b), json=body, headers=auth(a), timeout=30)
    no_key = httpx.post(chat_url(b), json=body, timeout=30)
    garbage_key = httpx.post(chat_url(b), json=body, headers={"x-api-key": "not-a-key-at-all"}, timeout=30)
    for response in (with_a_key, no_key, garbage_key):
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
    own = httpx.post(chat_url(b), json=body, headers=auth(b), timeout=30)
    by_key = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers=auth(a), timeout=30)
    assert own.status_code == 200 and by_key.status_code == 200
    events = await proxy.completions(2)
    assert [(e.session_id, e.sequence, e.status) for e in events] == sorted(
        [(a["session_id"], 0, "ok"), (b["session_id"], 0, "ok")])


@pytest.mark.parametrize("header", ["authorization", "x-api-key", "x-goog-api-key", "query"])
def test_fault1_each_key_form_is_checked_on_every_api(proxy: ProxyUnderTest, header: str) -> None:
    a, b = proxy.new_session(), proxy.new_session()
    paths = {"openai": "/chat/completions", "anthropic": "/v1/messages",
             "gemini": "/v1beta/models/m:generateContent"}
    for api, path in paths.items():
        url = b["base_urls"][api] + path
        for session, expected in ((a, 401), (b, 400)):  # the body is invalid: 400 only once authenticated
            key = session["api_key"]
            if header == "query":
                response = httpx.post(url, params={"key": key}, json={"nothing": 1}, timeout=30)
            else:
                value = f"Bearer {key}" if header == "authorization" else key
                response = httpx.post(url, headers={header: value}, json={"nothing": 1}, timeout=30)
            assert response.status_code == expected, (api, header, response.text)


# -- fault 3: JSON nested deeper than the limit --------------------------------------------------------

@pytest.mark.parametrize("where", ["tools", "tool_choice", "chat_template_kwargs", "arguments"])
async def test_fault3_deep_json_is_400_and_recorded(proxy: ProxyUnderTest, where: str) -> None:
    session = proxy.new_session()
    body: dict = {"messages": list(MESSAGES)}
    deep = nested(300)
    if where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    elif where == "tool_choice":
        body["tool_choice"] = deep
    elif where == "chat_template_kwargs":
        body["chat_template_kwargs"] = {"x": deep}
    else:  # JSON text inside a tool call's arguments
        body["messages"] = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(deep)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    response = httpx.post(chat_url(session), content=json.dumps(body), timeout=30,
                          headers={"content-type": "application/json", **auth(session)})
    assert response.status_code == 400, response.text
    assert "nested deeper" in response.json()["error"]["message"]
    [event] = await proxy.completions(1)
    assert event.status == "error" and event.error.kind == "bad_request" and event.error.http_status == 400


# -- fault 4: bodies the event record cannot hold ------------------------------------------------------

async def test_fault4_body_over_the_record_budget_is_413_recorded_and_producer_kept(
        kafka: KafkaSettings, standin_url: str) -> None:
    """The default body limit is half the record limit: a body between that and the old 16 MiB limit is
    refused with a non-retryable 413, recorded as a failed call, and the producer is not thrown away."""
    with serve(create_app(proxy_settings(standin_url), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        big = {"messages": [{"role": "user", "content": "x" * (kafka.max_message_bytes // 2 + 1024)}]}
        response = httpx.post(chat_url(session), json=big, headers=auth(session), timeout=60)
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "payload_too_large"
        health = httpx.get(f"{url}/health").json()
        assert health["kafka"] is True
        assert httpx.post(chat_url(session), json={"messages": MESSAGES}, headers=auth(session),
                          timeout=30).status_code == 200
        refused, ok = await proxy.completions(2)
        assert refused.status == "error" and refused.error.kind == "payload_too_large"
        assert refused.request.messages == [] and refused.request_digest is None  # never read past the limit
        assert ok.status == "ok" and ok.sequence == 1


@pytest.mark.parametrize("fits_engine", [True, False])
async def test_fault4_event_over_the_record_limit_is_slimmed_not_lost(kafka: KafkaSettings, fits_engine: bool) -> None:
    """A deployment that raises the body limit above the record limit: a call whose event cannot be
    recorded whole leaves a slimmed failed-call event (request dropped, the engine's tokens kept) and the
    producer is kept. Served by the engine, the harness gets a 413; refused by it (context overflow), the
    engine's own error."""
    from tests.support.standin_engine import StandinConfig, create_app as create_standin

    limit = kafka.max_message_bytes * 2
    # 8 bytes a token and a long context: the request fits the stand-in, but not one Kafka record.
    config = StandinConfig(latency_ms=1, reply_tokens=4, bytes_per_token=8, max_model_len=4_000_000) if fits_engine \
        else StandinConfig(latency_ms=1, reply_tokens=4)
    engine = create_standin(config)
    with serve(engine) as engine_url, \
            serve(create_app(proxy_settings(engine_url, proxy_max_body_bytes=limit), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        text = "y" * (kafka.max_message_bytes + 4096)
        response = httpx.post(chat_url(session), headers=auth(session), timeout=120,
                              json={"messages": [{"role": "system", "content": text}, *MESSAGES], "max_tokens": 4})
        assert response.status_code == (413 if fits_engine else 400), response.text
        assert httpx.get(f"{url}/health").json()["kafka"] is True
        [event] = await proxy.completions(1, timeout_s=60)
        assert event.status == "error"
        assert event.request.messages == [] and event.request_digest is not None
        if fits_engine:
            assert event.error.kind == "payload_too_large"
            assert event.token_ids is not None and len(event.token_ids) > 0  # the engine's tokens are kept
        else:
            assert event.error.kind == "context_overflow"


# -- fault 5: engine stream faults ---------------------------------------------------------------------

@pytest.mark.parametrize("fail", ["error_string", "error_object", "no_finish", "garbage"])
async def test_fault5_engine_stream_fault_is_an_error_not_a_stop(proxy: ProxyUnderTest, fail: str) -> None:
    session = proxy.new_session(engine={"extra": {"standin_fail": fail}})
    with httpx.stream("POST", chat_url(session), json={"messages": MESSAGES, "stream": True},
                      headers=auth(session), timeout=30) as response:
        text = response.read().decode()  # read to the end: no connection reset
    if response.status_code == 200:  # the stream had started: the error is told in it
        payloads = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in payloads and '"finish_reason":"' not in text
        assert "error" in json.loads(payloads[-1])
    else:
        assert response.status_code == 502 and json.loads(text)["error"]["code"] == "engine_error"
    [event] = await proxy.completions(1)
    assert event.status == "error" and event.error.kind == "engine_error"
    assert event.finish_reason is None
    if fail == "no_finish":
        assert "finish reason" in event.error.message
        assert event.token_ids is not None and len(event.token_ids) > 0  # the partial turn is kept


async def test_fault5_whole_reply_without_finish_reason_is_502(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(engine={"extra": {"standin_fail": "no_token_ids"}})
    response = httpx.post(chat_url(session), json={"messages": MESSAGES}, headers=auth(session), timeout=30)
    assert response.status_code == 502 and "prompt_token_ids" in response.json()["error"]["message"]
    [event] = await proxy.completions(1)
    assert event.error.kind == "engine_error"


# -- fault 6: every call number has an event -----------------------------------------------------------

async def test_fault6_every_authenticated_call_leaves_one_event(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    base = session["base_urls"]
    json_headers = {"content-type": "application/json", **auth(session)}
    sent = [
        httpx.post(chat_url(session), json={"messages": MESSAGES}, headers=auth(session), timeout=30),
        httpx.post(chat_url(session), content=b"{not json", headers=json_headers, timeout=30),
        httpx.post(chat_url(session), content=b"{}", headers={"content-type": "text/plain", **auth(session)},
                   timeout=30),
        httpx.post(chat_url(session), json={"messages": [{"role": "wizard", "content": 1}]}, headers=auth(session),
                   timeout=30),
        httpx.post(f"{base['anthropic']}/v1/messages", json={"model": "m", "messages": "nope"},
                   headers=auth(session), timeout=30),
        httpx.post(f"{base['gemini']}/v1beta/models/m:explode", json={}, headers=auth(session), timeout=30),
        httpx.post(f"{base['openai']}/responses", json={"model": "m", "input": 7}, headers=auth(session),
                   timeout=30),
    ]
    assert [r.status_code for r in sent] == [200, 400, 415, 400, 400, 404, 400], [r.text for r in sent]
    events = await proxy.completions(len(sent))
    assert [e.sequence for e in events] == list(range(len(sent)))
    assert [e.status for e in events] == ["ok"] + ["error"] * (len(sent) - 1)
    assert [e.error.http_status for e in events[1:]] == [r.status_code for r in sent[1:]]
    assert [e.api for e in events] == ["openai.chat"] * 4 + ["anthropic.messages", "gemini", "openai.responses"]
    assert events[1].request.messages == [] and events[1].request_digest is not None


# -- fault 7: the key before the body; provider-shaped 404 and 405 -------------------------------------

def test_fault7_key_is_checked_before_the_body(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    cases = [(b"{not json", "application/json"), (b"{}", "text/plain"), (b"x" * 100, "application/json")]
    for content, media_type in cases:
        response = httpx.post(chat_url(session), content=content, headers={"content-type": media_type}, timeout=30)
        assert response.status_code == 401, response.text
        response = httpx.post(f"{proxy.url}/v1/messages", content=content, timeout=30,
                              headers={"content-type": media_type, "x-api-key": "wrong-key-123"})
        assert response.status_code == 401 and response.json()["type"] == "error"


@pytest.mark.parametrize("method, path, shape", [
    ("GET", "/v1/chat/completions", "openai"),
    ("DELETE", "/s/x/v1/chat/completions", "openai"),
    ("POST", "/v1/chat/completion", "openai"),
    ("PUT", "/v1/responses", "openai"),
    ("GET", "/v1/messages", "anthropic"),
    ("POST", "/s/x/v1/messages/batches", "anthropic"),
    ("GET", "/v1beta/models/m:generateContent", "gemini"),
    ("POST", "/v1beta/tunedModels/m:generateContent", "gemini"),
])
def test_fault7_wrong_method_or_path_in_provider_shape(proxy: ProxyUnderTest, method: str, path: str,
                                                       shape: str) -> None:
    response = httpx.request(method, f"{proxy.url}{path}", json={}, timeout=30)
    assert response.status_code in (404, 405), response.text
    body = response.json()
    if shape == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}
    elif shape == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert body["error"]["code"] == response.status_code and body["error"]["status"]
    assert "detail" not in body
