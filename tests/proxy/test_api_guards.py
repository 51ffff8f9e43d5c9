"""rollwire's own HTTP APIs (the proxy's session API, the rollout server, a gateway node's control
endpoint) against a session that reaches for another's data and against values the log cannot hold.

The standards: one session can never read or write another's data; bad input gets a clear error in the
caller's own protocol (a 4xx with a message for an API caller); nothing already accepted is lost. Each case
was found by sending the request to the running services (an audit of this round); each names the request
and what it did before.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from producers.gateway.control import create_app as create_control_app
from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings
from schemas.sessions import SessionEnded, SessionSpec
from schemas.tasks import TaskAccepted
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.producers.rollout_helpers import rollout_server, task_body
from tests.proxy.conftest import ProxyUnderTest, auth

pytestmark = pytest.mark.kafka

JSON = {"content-type": "application/json"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _events(kafka: KafkaSettings, topic: Topic, settle_s: float = 2.0) -> list:
    """Every event on ``topic`` that decodes (read for ``settle_s``; undecodable records are skipped)."""
    got: list = []
    async with EventConsumer(kafka, [topic], group_id=None, dead_letters=False) as consumer:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settle_s
        while loop.time() < deadline:
            got.extend(r.event for r in await consumer.getmany(timeout_ms=300))
    return got


# -- 1. session isolation on the proxy's session API ---------------------------------------------------

async def test_a_sibling_key_or_no_key_cannot_end_another_session(proxy: ProxyUnderTest) -> None:
    """``POST /v1/sessions/{B}/end`` takes no credential at all: session A's harness (or anything that reaches
    the proxy, e.g. an agent in a relay container, whose one way out is the proxy) ends its sibling B, whose
    id is predictable (``{task_id}-s{n}``). B's harness is then refused with 401 "has ended", and a gateway node
    running B reads ``live: false`` from the proxy. Before: 200, ``live: false``, a ``session.ended`` on the log."""
    a = proxy.new_session(session_id="task-s0")
    b = proxy.new_session(session_id="task-s1")
    for headers in (auth(a), {}):
        answer = httpx.post(f"{proxy.url}/v1/sessions/{b['session_id']}/end", headers={**JSON, **headers},
                            json={"status": "error", "reason": "ended by a sibling"}, timeout=30)
        assert answer.status_code in (401, 403, 404), answer.text
    call = httpx.post(f"{b['base_urls']['openai']}/chat/completions", headers=auth(b), json=CHAT, timeout=30)
    assert call.status_code == 200, call.text
    events = await _events(proxy.kafka, Topic.SESSION_EVENTS)
    assert not [e for e in events if isinstance(e, SessionEnded) and e.session_id == b["session_id"]]


def test_a_sibling_key_cannot_read_another_sessions_state(proxy: ProxyUnderTest) -> None:
    """``GET /v1/sessions/{B}`` answers B's liveness, call count and origin to anyone (A's key, or none)."""
    a = proxy.new_session()
    b = proxy.new_session()
    httpx.post(f"{b['base_urls']['openai']}/chat/completions", headers=auth(b), json=CHAT, timeout=30)
    for headers in (auth(a), {}):
        answer = httpx.get(f"{proxy.url}/v1/sessions/{b['session_id']}", headers=headers, timeout=30)
        assert answer.status_code in (401, 403, 404), answer.text


async def test_an_ended_session_cannot_be_ended_again_with_another_outcome(proxy: ProxyUnderTest) -> None:
    """A second ``end`` of an ended session writes a second ``session.ended`` with a new status (the
    rollout server's view and the task's result take the last one): an accepted outcome is overwritten."""
    b = proxy.new_session()
    url = f"{proxy.url}/v1/sessions/{b['session_id']}/end"
    first = httpx.post(url, headers={**JSON, **auth(b)}, json={"status": "completed"}, timeout=30)
    assert first.status_code == 200, first.text
    again = httpx.post(url, headers={**JSON, **auth(b)}, json={"status": "error", "reason": "flip"}, timeout=30)
    assert again.status_code == 409, again.text
    events = await _events(proxy.kafka, Topic.SESSION_EVENTS)
    ends = [e for e in events if isinstance(e, SessionEnded) and e.session_id == b["session_id"]]
    assert [e.status.value for e in ends] == ["completed"]


async def test_an_adhoc_session_cannot_preclaim_a_rollout_sessions_id(proxy: ProxyUnderTest, tmp_path: Path) -> None:
    """Anyone who reaches the proxy registers ``POST /v1/sessions {"session_id": "victim-s0"}`` with a key of
    its own and makes calls; when the rollout server later accepts task ``victim`` (it checks task ids only),
    its session ``victim-s0`` reuses that id: the spec is replaced, and the calls made before are the rollout
    session's calls 0..n (the UI shows them, the trajectory worker builds them into its trajectory).
    Either the task must be refused, or its sessions must not reuse the taken id."""
    squatter = proxy.new_session(session_id="victim-s0")
    injected = httpx.post(f"{squatter['base_urls']['openai']}/chat/completions", headers=auth(squatter),
                          json={"model": "m", "messages": [{"role": "user", "content": "INJECTED"}]}, timeout=30)
    assert injected.status_code == 200, injected.text
    with rollout_server(proxy.kafka, tmp_path / "rollout") as url:
        answer = httpx.post(f"{url}/v1/tasks", json=task_body("victim", samples=1), timeout=30)
    if answer.status_code == 202:
        assert "victim-s0" not in answer.json()["session_ids"], answer.text
    else:
        assert answer.status_code == 409, answer.text


# -- 2. bad input to rollwire's own APIs: 4xx with a message, never a 500 or an unreadable event ---------

@pytest.mark.parametrize("body", [
    '{"timeout_s": 1e999}',
    '{"engine": {"seed": 100000000000000000000}}',
    '{"engine": {"max_tokens": 100000000000000000000000}}',
])
async def test_session_values_the_log_cannot_hold_are_refused(proxy: ProxyUnderTest, body: str) -> None:
    """``POST /v1/sessions`` accepts (201) an infinite ``timeout_s`` or an integer past 64 bits; the spec it
    writes is then undecodable on the log (every consumer skips it: another proxy instance, this one after a
    restart, the trajectory worker, the UI), so an accepted session is lost. Refuse it with 422 instead."""
    answer = httpx.post(f"{proxy.url}/v1/sessions", content=body.encode(), headers=JSON, timeout=30)
    if answer.status_code == 201:
        created = answer.json()["session_id"]
        events = await _events(proxy.kafka, Topic.SESSIONS)
        assert [e for e in events if isinstance(e, SessionSpec) and e.session_id == created], \
            "the session was accepted but its spec cannot be read back from the log"
    else:
        assert answer.status_code == 422 and answer.json()["detail"], answer.text


@pytest.mark.parametrize("path, body", [
    ("/v1/sessions", b'{"task_id": "\\ud800"}'),
    ("/v1/sessions", b'{"metadata": {"x": "\\ud800"}}'),
    ("/v1/sessions/{id}/end", b'{"reason": "\\ud800"}'),
])
def test_session_api_lone_surrogates_are_a_4xx_with_detail(proxy: ProxyUnderTest, path: str, body: bytes) -> None:
    """Before: 500 with an OpenAI-shaped error (``code: payload_too_large``) and a traceback in the log: the
    string is valid JSON but cannot be encoded as UTF-8 for Kafka (``proxy/app.py`` ``_publish`` catches only
    CaptureFailed; the ``unexpected`` handler renders rollwire's own API in OpenAI's shape)."""
    session = proxy.new_session()
    answer = httpx.post(proxy.url + path.format(id=session["session_id"]), content=body,
                        headers={**JSON, **auth(session)}, timeout=30)
    assert 400 <= answer.status_code < 500, answer.text
    assert isinstance(answer.json().get("detail"), str), answer.text


def test_session_api_body_over_the_record_limit_is_413_with_detail(proxy: ProxyUnderTest) -> None:
    """A 9 MiB ``metadata`` on ``POST /v1/sessions`` is read whole (no body limit on this route) and answered
    500 in OpenAI's shape; it should be a 413 ``{"detail": ...}`` like the provider routes' body limit."""
    body = json.dumps({"metadata": {"x": "a" * (9 * 1024 * 1024)}}).encode()
    answer = httpx.post(f"{proxy.url}/v1/sessions", content=body, headers=JSON, timeout=60)
    assert answer.status_code == 413, answer.text[:300]
    assert isinstance(answer.json().get("detail"), str), answer.text[:300]


@pytest.mark.parametrize("extra", [
    {"timeout_s": "__inf__"},
    {"engine": {"seed": 100000000000000000000}},
])
async def test_rollout_task_values_the_log_cannot_hold_are_refused(kafka: KafkaSettings, tmp_path: Path,
                                                                  extra: dict) -> None:
    """``POST /v1/tasks`` answers 202 for ``timeout_s: 1e999`` or an integer past 64 bits, and writes a
    ``task.accepted`` and specs that no consumer can decode: gateway nodes skip them (the task never runs),
    a restarted rollout server no longer knows the task. Refuse with 422."""
    body = json.dumps(task_body("unreadable", samples=1, **extra)).replace('"__inf__"', "1e999")
    with rollout_server(kafka, tmp_path / "rollout") as url:
        answer = httpx.post(f"{url}/v1/tasks", content=body.encode(), headers=JSON, timeout=30)
    if answer.status_code == 202:
        events = await _events(kafka, Topic.TASKS)
        assert [e for e in events if isinstance(e, TaskAccepted) and e.task_id == "unreadable"], \
            "the task was accepted but its task.accepted cannot be read back from the log"
    else:
        assert answer.status_code == 422, answer.text


@pytest.mark.parametrize("body", [
    '{"task_id": "sur", "instruction": "\\ud800", "agent": {"harness": "qwen-code"}}',
    '{"task_id": "ns", "instruction": "x", "agent": {"harness": "qwen-code"}, "num_samples": 1e999}',
    '{"task_id": "cpu", "instruction": "x", "agent": {"harness": "qwen-code"}, '
    '"runtime": {"kind": "docker", "image": "i", "cpus": 1e999}}',
])
def test_rollout_server_bad_values_are_422_not_500(kafka: KafkaSettings, tmp_path: Path, body: str) -> None:
    """FastAPI's default validation handler echoes the offending ``input`` into the 422 body; a lone
    surrogate or an infinity cannot be encoded as JSON, so the answer is a plain-text 500 "Internal Server
    Error" with a traceback (``producers/rollout/server.py`` has no RequestValidationError handler). An
    infinite ``runtime.cpus`` on an otherwise valid docker task is worse: 202, and its spec and
    ``task.accepted`` are undecodable on the log (the task is lost)."""
    with rollout_server(kafka, tmp_path / "rollout") as url:
        answer = httpx.post(f"{url}/v1/tasks", content=body.encode(), headers=JSON, timeout=30)
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"], answer.text


async def test_gateway_node_cancel_with_a_lone_surrogate_is_422() -> None:
    """``POST /v1/sessions/{id}/cancel {"reason": "\\ud800"}`` on a gateway node: a plain-text 500 before,
    for the same reason as the rollout server (``producers/gateway/control.py``)."""
    node = GatewayNode(GatewaySettings(), KafkaSettings(topic_prefix="audit-unused."))
    transport = httpx.ASGITransport(app=create_control_app(node), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        answer = await client.post("/v1/sessions/s1/cancel", content=b'{"reason": "\\ud800"}', headers=JSON)
    assert answer.status_code == 422, answer.text
