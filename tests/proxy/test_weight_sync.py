"""Weight sync through the proxy against the stand-in engine (vLLM's recorded shapes, dev mode): the gate
holds new calls during an update and drains running ones first, completions carry the version they were
sampled under, versions only go up, one update at a time, the admin token, an engine failure, a session's
policy floor, and the ``policy`` topic's event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.standin_engine import Standin, StandinConfig
from proxy.app import create_app
from schemas.completions import Completion
from schemas.policy import WeightsUpdated
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

MESSAGES = [{"role": "user", "content": "fix the test"}]


@dataclass
class Rig:
    """A proxy in front of a stand-in engine whose state the test can read."""

    proxy: ProxyUnderTest
    engine: Standin
    engine_url: str
    checkpoint: str

    @property
    def url(self) -> str:
        return self.proxy.url

    def session(self, **body: Any) -> dict:
        return self.proxy.new_session(**body)


@contextmanager
def rig(kafka: KafkaSettings, tmp_path: Path, *, dev_mode: bool = True, **settings: Any) -> Iterator[Rig]:
    config = StandinConfig(latency_ms=1, reply_tokens=8, token_api=True, dev_mode=dev_mode,
                           reload_ms=float(settings.pop("reload_ms", 50.0)),
                           token_interval_ms=float(settings.pop("token_interval_ms", 0.0)))
    engine = Standin(config)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir(exist_ok=True)
    with serve(engine.app()) as engine_url, \
            serve(create_app(proxy_settings(engine_url, **settings), kafka)) as url:
        yield Rig(ProxyUnderTest(url, kafka, settings.get("proxy_admin_token")), engine, engine_url, str(checkpoint))


def push(url: str, path: str, version: str, headers: dict[str, str] | None = None,
         **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/policy/weights", json={"weights_path": path, "version": version, **body},
                      headers=headers, timeout=30)


async def apush(url: str, path: str, version: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(f"{url}/v1/policy/weights",
                                 json={"weights_path": path, "version": version, **body})


async def achat(session: dict, messages: list[dict] | None = None, stream: bool = False,
                timeout: float = 60) -> tuple[httpx.Response, float, float]:
    """One chat call; the response and when it started and ended (monotonic)."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout) as client:
        response = await client.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                                     json={"model": "m", "messages": messages or MESSAGES, "stream": stream})
    return response, started, time.monotonic()


async def until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def policy_events(kafka: KafkaSettings, want: int, timeout_s: float = 20.0) -> list[WeightsUpdated]:
    """The pushes on the ``policy`` topic (the proxy tier's heartbeats and gates left out)."""
    got: list[WeightsUpdated] = []
    async with EventConsumer(kafka, [Topic.POLICY], group_id=None, dead_letters=False) as consumer:
        async def loop() -> None:
            while len(got) < want:
                got.extend(r.event for r in await consumer.getmany(timeout_ms=300)
                           if isinstance(r.event, WeightsUpdated))
        await asyncio.wait_for(loop(), timeout_s)
    return got


def by_sequence(events: list[Completion], session: dict) -> list[Completion]:
    return [e for e in events if e.session_id == session["session_id"]]


async def test_call_during_update_is_held_then_served_on_the_new_version(kafka: KafkaSettings,
                                                                          tmp_path: Path) -> None:
    with rig(kafka, tmp_path, reload_ms=800) as r:
        session = r.session()
        assert httpx.get(f"{r.url}/v1/policy", timeout=10).json()["version"] == "0"
        update = asyncio.create_task(apush(r.url, r.checkpoint, "1"))
        update_began = time.monotonic()
        await until(lambda: httpx.get(f"{r.url}/v1/policy", timeout=10).json()["updating"])
        calls = [asyncio.create_task(achat(session, stream=stream)) for stream in (False, True, False)]
        await until(lambda: httpx.get(f"{r.url}/v1/policy", timeout=10).json()["held_calls"] == 3)
        assert httpx.get(f"{r.url}/v1/policy", timeout=10).json()["holding"]
        answer = await update
        update_ended = time.monotonic()
        assert answer.status_code == 200, answer.text
        state = answer.json()
        assert state["version"] == "1" and state["updates"] == 1 and not state["updating"] and not state["holding"]
        assert state["last_paused_ms"] >= 800
        for response, started, ended in await asyncio.gather(*calls):
            assert response.status_code == 200, response.text  # held, never failed
            assert started > update_began and ended >= update_ended - 0.05
        events = by_sequence(await r.proxy.completions(3), session)
        assert [e.policy_version for e in events] == ["1", "1", "1"] and all(e.status == "ok" for e in events)
        assert r.engine.loaded_paths == [r.checkpoint] and r.engine.weight_version == "1"
        assert r.engine.prefix_cache_resets == 1
        [event] = await policy_events(kafka, 1)
        assert (event.status, event.version, event.previous_version, event.weights_path) == \
            ("ok", "1", "0", r.checkpoint)
        assert event.served_model == "rollwire-tiny" and event.held_calls == 3 and event.drained_calls == 0
        assert event.load_ms >= 800 and event.paused_ms >= event.load_ms
        metrics = httpx.get(f"{r.url}/metrics", timeout=10).text
        assert 'rollwire_proxy_weight_updates_total{status="ok"} 1.0' in metrics
        assert "rollwire_proxy_calls_held_total 3.0" in metrics and "rollwire_proxy_policy_version 1.0" in metrics


async def test_calls_in_flight_finish_first_on_the_old_version(kafka: KafkaSettings, tmp_path: Path) -> None:
    """The update waits for running calls (a stream on the chat path, a continued whole call on generate);
    they keep version 0, later ones get the new version, and generate's spans name it."""
    with rig(kafka, tmp_path, token_interval_ms=60) as r:
        session, other = r.session(), r.session()
        first, _, _ = await achat(session)
        assert first.status_code == 200
        history = MESSAGES + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
        running = [asyncio.create_task(achat(other, stream=True)),
                   asyncio.create_task(achat(session, history + [{"role": "user", "content": "again"}]))]
        await until(lambda: r.engine.requests >= 3)
        update = asyncio.create_task(apush(r.url, r.checkpoint, "v1"))
        await asyncio.sleep(0.2)
        assert not update.done() and r.engine.loaded_paths == []  # draining: the engine is not touched yet
        finished = await asyncio.gather(*running)
        assert all(response.status_code == 200 for response, _, _ in finished)
        answer = await update
        assert answer.status_code == 200, answer.text
        assert answer.json()["version"] == "v1"
        second = finished[1][0].json()["choices"][0]["message"]["content"]
        followed, _, _ = await achat(session, history + [{"role": "user", "content": "again"},
                                                         {"role": "assistant", "content": second},
                                                         {"role": "user", "content": "once more"}])
        assert followed.status_code == 200
        events = await r.proxy.completions(4)
        mine, theirs = by_sequence(events, session), by_sequence(events, other)
        assert [e.policy_version for e in theirs] == ["0"] and theirs[0].weight_versions is None  # chat path
        assert [e.continuation.mode for e in mine if e.continuation] == ["rendered", "exact", "exact"]
        assert [e.policy_version for e in mine] == ["0", "0", "v1"]
        assert mine[1].weight_versions == [{"version": "0", "start": 0, "end": len(mine[1].token_ids)}]
        assert mine[2].weight_versions == [{"version": "v1", "start": 0, "end": len(mine[2].token_ids)}]
        [event] = await policy_events(kafka, 1)
        assert event.drained_calls == 2 and event.held_calls == 0


async def test_versions_only_go_up_and_one_update_at_a_time(kafka: KafkaSettings, tmp_path: Path) -> None:
    with rig(kafka, tmp_path, reload_ms=400) as r:
        both = await asyncio.gather(apush(r.url, r.checkpoint, "2"), apush(r.url, r.checkpoint, "3"))
        codes = sorted(response.status_code for response in both)
        assert codes == [200, 409], [response.text for response in both]
        refused = next(response for response in both if response.status_code == 409)
        assert "in progress" in refused.json()["detail"]
        current = httpx.get(f"{r.url}/v1/policy", timeout=10).json()["version"]
        for stale in (current, "1", "v0"):
            response = push(r.url, r.checkpoint, stale)
            assert response.status_code == 409 and "only go up" in response.json()["detail"], response.text
        assert push(r.url, r.checkpoint, "v9").status_code == 200
        assert len(r.engine.loaded_paths) == 2
        bad = httpx.post(f"{r.url}/v1/policy/weights", json={"weights_path": r.checkpoint, "version": "nine"},
                         timeout=10)
        assert bad.status_code == 422 and bad.json()["detail"].startswith("version")


async def test_admin_token_is_required_when_set(kafka: KafkaSettings, tmp_path: Path) -> None:
    with rig(kafka, tmp_path, proxy_admin_token="admin-secret-1") as r:
        session = r.session()
        # Creating a session is the operator's too: a session's key, or none, is refused.
        for headers in ({}, auth(session)):
            refused = httpx.post(f"{r.url}/v1/sessions", json={}, headers=headers, timeout=10)
            assert refused.status_code == 401 and "admin token" in refused.json()["detail"], refused.text
        for headers in ({}, auth(session), {"authorization": "Bearer wrong"}, {"x-api-key": "admin-secret-1"}):
            got = httpx.get(f"{r.url}/v1/policy", headers=headers, timeout=10)
            assert got.status_code == 401 and "admin token" in got.json()["detail"], got.text
            posted = push(r.url, r.checkpoint, "1", headers=headers)
            assert posted.status_code == 401 and "admin token" in posted.json()["detail"], posted.text
        assert r.engine.loaded_paths == []
        admin = {"authorization": "Bearer admin-secret-1"}
        assert httpx.get(f"{r.url}/v1/policy", headers=admin, timeout=10).json()["version"] == "0"
        assert push(r.url, r.checkpoint, "1", headers=admin).json()["version"] == "1"


async def test_engine_failure_answers_502_reopens_the_gate_and_records_a_failed_update(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    with rig(kafka, tmp_path) as r:
        session = r.session()
        missing = str(tmp_path / "no-such-checkpoint")
        response = push(r.url, missing, "1")
        assert response.status_code == 502, response.text
        detail = response.json()["detail"]
        assert "collective_rpc" in detail and missing in detail and "previous weights" in detail
        # A failed load leaves vLLM's model half-loaded: the proxy loaded the served checkpoint again.
        assert r.engine.loaded_paths == ["rollwire-tiny"] and not r.engine.broken
        state = httpx.get(f"{r.url}/v1/policy", timeout=10).json()
        assert state["version"] == "0" and not state["updating"] and state["updates"] == 0
        assert httpx.get(f"{r.engine_url}/is_paused", timeout=10).json() == {"is_paused": False}  # resumed
        reply, _, _ = await achat(session)  # the gate is open again
        assert reply.status_code == 200
        [event] = await policy_events(kafka, 1)
        assert (event.status, event.version, event.previous_version) == ("failed", "0", "0")
        assert event.error is not None and missing in event.error and "version 1" in event.error
        [completion] = await r.proxy.completions(1)
        assert completion.policy_version == "0"
        metrics = httpx.get(f"{r.url}/metrics", timeout=10).text
        assert 'rollwire_proxy_weight_updates_total{status="failed"} 1.0' in metrics


async def test_standin_weight_endpoints_answer_as_recorded(tmp_path: Path) -> None:
    """The stand-in's weight endpoints give the recorded vLLM replies' shapes (tests/fixtures/vllm/weights_*)."""
    from tests.support.standin_text import load_fixture

    engine = Standin(StandinConfig(latency_ms=1, dev_mode=True, token_api=True))
    with serve(engine.app()) as url, httpx.Client(base_url=url, timeout=10) as client:
        for name in ("info", "pause", "is_paused", "reload", "reload_missing", "update_version",
                     "reset_prefix_cache", "resume", "info_updated", "generate"):
            recorded = load_fixture(f"weights_{name}.json")
            body = recorded["request"]
            if name == "reload":
                body = {**body, "kwargs": {"weights_path": str(tmp_path)}}
            got = client.request(recorded["method"], recorded["path"], json=body)
            assert got.status_code == recorded["status"], (name, got.text)
            reply, expected = got.json(), recorded["response"]
            assert reply.keys() == expected.keys(), name
            if name == "generate":
                assert reply["choices"][0]["weight_versions"] == [
                    {"version": "1", "start": 0, "end": len(reply["choices"][0]["token_ids"])}]
            elif name in ("info", "pause", "is_paused", "update_version", "reset_prefix_cache", "resume",
                          "info_updated", "reload"):
                assert reply == expected, name
            else:  # the failed load; the recorder then loads the served folder again
                assert reply["error"].keys() == expected["error"].keys()
                assert client.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
        # A failed load breaks the engine (every request fails) until a load succeeds, as on vLLM 0.32.
        assert client.post("/collective_rpc", json=load_fixture("weights_reload_missing.json")["request"]) \
            .status_code == 500
        assert client.post("/v1/chat/completions", json={"messages": MESSAGES}).status_code == 500
        assert client.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": MESSAGES}).status_code == 200


async def test_drain_timeout_fails_the_update_and_changes_nothing(kafka: KafkaSettings, tmp_path: Path) -> None:
    with rig(kafka, tmp_path, token_interval_ms=150) as r:
        session = r.session()
        running = asyncio.create_task(achat(session, stream=True))
        await until(lambda: r.engine.requests >= 1)
        response = await apush(r.url, r.checkpoint, "1", drain_timeout_s=0.2)
        assert response.status_code == 504 and "drain_timeout_s" in response.json()["detail"], response.text
        assert r.engine.loaded_paths == [] and r.engine.weight_version == "default"
        finished, _, _ = await running
        assert finished.status_code == 200
        [event] = await policy_events(kafka, 1)
        assert event.status == "failed" and event.drained_calls == 1


async def test_policy_floor_holds_calls_until_the_engine_serves_it(kafka: KafkaSettings, tmp_path: Path) -> None:
    with rig(kafka, tmp_path, policy_floor_wait_s=30) as r:
        waiting = r.session(policy_version="v1")
        labelled = r.session(policy_version="step-12")  # not a number: not a floor
        reply, _, _ = await achat(labelled)
        assert reply.status_code == 200
        held = asyncio.create_task(achat(waiting))
        await until(lambda: httpx.get(f"{r.url}/v1/policy", timeout=10).json()["held_calls"] == 1)
        assert push(r.url, r.checkpoint, "1").status_code == 200
        response, _, _ = await held
        assert response.status_code == 200, response.text
        events = await r.proxy.completions(2)
        assert [e.policy_version for e in by_sequence(events, labelled)] == ["0"]
        assert [e.policy_version for e in by_sequence(events, waiting)] == ["1"]


async def test_policy_floor_not_reached_is_an_error_in_the_callers_protocol(kafka: KafkaSettings,
                                                                            tmp_path: Path) -> None:
    with rig(kafka, tmp_path, policy_floor_wait_s=0.3) as r:
        session = r.session(policy_version="5")
        reply, started, ended = await achat(session)
        assert reply.status_code == 503 and ended - started >= 0.3
        error = reply.json()["error"]
        assert "policy version 5" in error["message"] and error["type"] == "server_error"
        anthropic = httpx.post(f"{r.url}/s/{session['session_id']}/v1/messages", headers=auth(session), timeout=30,
                               json={"model": "m", "max_tokens": 8, "messages": MESSAGES})
        assert anthropic.status_code == 503
        assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "overloaded_error"
        assert "policy version 5" in anthropic.json()["error"]["message"]
        events = await r.proxy.completions(2)
        assert all(e.status == "error" and e.error.kind == "engine_unavailable" for e in events)
        assert r.engine.requests == 0


async def test_engine_without_weight_endpoints_gives_no_version_and_no_error(kafka: KafkaSettings,
                                                                            tmp_path: Path) -> None:
    """vLLM without VLLM_SERVER_DEV_MODE answers 404 on /weight_info: chat-path completions carry no version,
    a numeric session version is not held, and the policy API says why it cannot work."""
    with rig(kafka, tmp_path, dev_mode=False, policy_floor_wait_s=0.2) as r:
        session = r.session(policy_version="v7")
        reply, _, _ = await achat(session)
        assert reply.status_code == 200, reply.text
        [event] = await r.proxy.completions(1)
        assert event.policy_version is None and event.status == "ok"
        state = httpx.get(f"{r.url}/v1/policy", timeout=10)
        assert state.status_code == 503 and "VLLM_SERVER_DEV_MODE" in state.json()["detail"]
        update = push(r.url, r.checkpoint, "1")
        assert update.status_code == 503 and "VLLM_SERVER_DEV_MODE" in update.json()["detail"]
