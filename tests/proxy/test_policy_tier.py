"""Weight updates across a tier of proxy processes on one Kafka, in front of one stand-in engine (vLLM's recorded
weight endpoints): every process closes its gate and drains before the engine is paused, and all reopen at the
new version; a process killed while it drains is not waited for beyond the tier's timeout; a process started
during an update holds its calls until the update ends; a coordinator killed mid-update leaves no gate closed
for longer than the tier's timeout; two pushes to two processes at once run one at a time.

Proxies run in this process (each on its own server thread and event loop), except the ones a test kills,
which run as ``rollwire proxy`` processes of their own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from schemas.completions import Completion
from schemas.envelope import Event
from schemas.policy import TierGate, WeightsUpdated
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import free_port, serve
from tests.support.processes import ROOT, answers, kafka_env, rollwire_process
from tests.support.standin_engine import Standin, StandinConfig

pytestmark = pytest.mark.kafka

MESSAGES = [{"role": "user", "content": "fix the test"}]
HEARTBEAT_S, TIER_TIMEOUT_S = 0.25, 2.0
TIER = {"proxy_tier_heartbeat_s": HEARTBEAT_S, "proxy_tier_timeout_s": TIER_TIMEOUT_S}


# ---- helpers -----------------------------------------------------------------------------------------------


def engine(**config: Any) -> Standin:
    return Standin(StandinConfig(**{"latency_ms": 1, "reply_tokens": 8, "dev_mode": True, **config}))


@contextlib.contextmanager
def proxy(kafka: KafkaSettings, engine_url: str, name: str) -> Iterator[ProxyUnderTest]:
    """A proxy process of the tier named ``name``, served from this test process."""
    settings = proxy_settings(engine_url, proxy_instance=name, engine_timeout_s=60, **TIER)
    with serve(create_app(settings, kafka)) as url:
        yield ProxyUnderTest(url, kafka)


@dataclass
class ProxyProcess(ProxyUnderTest):
    """A proxy running as a process of its own, which a test may kill."""

    process: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@contextlib.contextmanager
def proxy_process(kafka: KafkaSettings, engine_url: str, name: str, log: Path) -> Iterator[ProxyProcess]:
    """``rollwire proxy`` named ``name`` as a process of its own (this checkout's code), killed on the way out."""
    env = kafka_env(kafka, dict(os.environ, PYTHONPATH=str(ROOT), ROLLWIRE_PROXY_INSTANCE=name,
                                ROLLWIRE_PROXY_TIER_HEARTBEAT_S=str(HEARTBEAT_S),
                                ROLLWIRE_PROXY_TIER_TIMEOUT_S=str(TIER_TIMEOUT_S), ROLLWIRE_SESSION_WAIT_S="0.3",
                                ROLLWIRE_ENGINE_TIMEOUT_S="60"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with rollwire_process(["proxy", "--port", str(port), "--engine-url", engine_url], env, log,
                          lambda: answers(f"{url}/health")) as process:
        yield ProxyProcess(url, kafka, process=process)


async def policy(proxy: ProxyUnderTest) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"{proxy.url}/v1/policy")
    assert response.status_code == 200, response.text
    return response.json()


async def until(check: Any, timeout_s: float = 20.0, what: str = "condition") -> None:
    """Wait until ``await check()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:g} s"
        await asyncio.sleep(0.05)


async def tier_of(*proxies: ProxyUnderTest) -> None:
    """Wait until every proxy hears from all of them, and none holds its gate."""
    async def known() -> bool:
        states = [await policy(p) for p in proxies]
        return all(len(s["tier"]) == len(proxies) and not s["holding"] for s in states)

    await until(known, what=f"a tier of {len(proxies)}")


async def paused(engine_url: str) -> bool:
    async with httpx.AsyncClient(timeout=10) as client:
        return bool((await client.get(f"{engine_url}/is_paused")).json()["is_paused"])


def arrivals_while_paused(standin: Standin) -> list[float]:
    """When calls reached the engine while it was paused (none should: every gate is closed then)."""
    arrived: list[float] = []
    wait = standin.until_running

    async def counted() -> None:
        if standin._running is not None and not standin._running.is_set():
            arrived.append(time.monotonic())
        await wait()

    standin.until_running = counted  # type: ignore[method-assign]
    return arrived


async def push(proxy: ProxyUnderTest, path: str, version: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{proxy.url}/v1/policy/weights",
                                 json={"weights_path": path, "version": version, **body})


async def chat(session: dict, stream: bool = False) -> tuple[httpx.Response | None, float, float]:
    """One call: its answer (None when the connection broke) and when it started and ended (monotonic)."""
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                                         json={"model": "m", "messages": MESSAGES, "stream": stream})
    except httpx.HTTPError:
        return None, started, time.monotonic()
    return response, started, time.monotonic()


async def policy_log(kafka: KafkaSettings, updates: int, timeout_s: float = 30.0) -> list[Event]:
    """Every event on the ``policy`` topic, read until ``updates`` WeightsUpdated events and the gates'
    opens after them are there."""
    got: list[Event] = []
    async with EventConsumer(kafka, [Topic.POLICY], group_id=None, dead_letters=False) as consumer:
        async def loop() -> None:
            while sum(isinstance(e, WeightsUpdated) for e in got) < updates or \
                    sum(isinstance(e, TierGate) and e.phase == "open" for e in got) < updates:
                got.extend(r.event for r in await consumer.getmany(timeout_ms=300))
        await asyncio.wait_for(loop(), timeout_s)
    return got


def gates(events: list[Event], update_id: str | None) -> list[tuple[str, str]]:
    return [(e.phase, e.instance) for e in events if isinstance(e, TierGate) and e.update_id == update_id]


def versions(events: list[Completion], session: dict) -> list[str | None]:
    return [e.policy_version for e in events if e.session_id == session["session_id"]]


# ---- the tests -----------------------------------------------------------------------------------------------


async def test_an_update_closes_and_drains_every_proxy_before_the_engine_changes(kafka: KafkaSettings,
                                                                                 tmp_path: Path) -> None:
    """Both processes close their gates and drain; the engine is paused only once the last call in flight on
    either is done; no call reaches the engine while it changes; calls held on either process carry the new
    version, calls in flight the old one; the update's event lists both processes."""
    standin = engine(token_interval_ms=100, reload_ms=600)
    while_paused = arrivals_while_paused(standin)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    with serve(standin.app()) as engine_url, proxy(kafka, engine_url, "proxy-a") as a, \
            proxy(kafka, engine_url, "proxy-b") as b:
        await tier_of(a, b)
        on_a, on_b = a.new_session(), b.new_session()
        late_a, late_b = a.new_session(), b.new_session()
        running_a = asyncio.create_task(chat(on_a, stream=True))
        await until(lambda: _true(standin.requests >= 1))
        await asyncio.sleep(0.4)
        running_b = asyncio.create_task(chat(on_b, stream=True))  # ends about 0.4 s after the one on a
        await until(lambda: _true(standin.requests >= 2))
        update = asyncio.create_task(push(a, str(checkpoint), "1"))
        await until(lambda: _both(a, b, "holding"), what="both gates closed")
        held = [asyncio.create_task(chat(late_a)), asyncio.create_task(chat(late_b, stream=True))]
        await until(lambda: _both(a, b, "held_calls"), what="a call held on each process")
        refused = await push(b, str(checkpoint), "2")  # one update at a time, across the tier
        assert refused.status_code == 409 and "in progress" in refused.json()["detail"], refused.text
        assert refused.json()["detail"].endswith("(coordinated by proxy-a); one at a time")
        await running_a
        # a has drained; the engine must not change while b's call runs.
        while not running_b.done():
            assert standin.loaded_paths == [], "the engine was loaded while a call ran on the other process"
            await asyncio.sleep(0.02)
        answer = await update
        assert answer.status_code == 200, answer.text
        assert answer.json()["version"] == "1" and sorted(answer.json()["tier"]) == ["proxy-a", "proxy-b"]
        assert while_paused == []  # the held calls reached the engine only after it resumed
        for task in [running_a, running_b, *held]:
            response, _, _ = await task
            assert response is not None and response.status_code == 200
        for p in (a, b):
            state = await policy(p)
            assert state["version"] == "1" and not state["holding"] and not state["updating"]
        completions = await a.completions(4)
        assert versions(completions, on_a) == ["0"] and versions(completions, on_b) == ["0"]
        assert versions(completions, late_a) == ["1"] and versions(completions, late_b) == ["1"]
    events = await policy_log(kafka, 1)
    [pushed] = [e for e in events if isinstance(e, WeightsUpdated)]
    assert (pushed.status, pushed.version, pushed.coordinator) == ("ok", "1", "proxy-a")
    parts = {part.instance: part for part in pushed.proxies}
    assert set(parts) == {"proxy-a", "proxy-b"} and {part.status for part in parts.values()} == {"drained"}
    assert parts["proxy-a"].drained_calls == 1 and parts["proxy-b"].drained_calls == 1
    assert parts["proxy-a"].held_calls == 1 and pushed.drained_calls == 2 and pushed.held_calls >= 1
    phases = gates(events, pushed.update_id)
    assert phases[0] == ("close", "proxy-a") and phases[-1] == ("open", "proxy-a")
    assert sorted(phases[1:-1]) == [("drained", "proxy-a"), ("drained", "proxy-b")]
    [opened] = [e for e in events if isinstance(e, TierGate) and e.phase == "open"]
    assert (opened.status, opened.version, opened.weights_path) == ("ok", "1", str(checkpoint))


async def test_a_proxy_killed_while_it_drains_is_not_waited_for(kafka: KafkaSettings, tmp_path: Path) -> None:
    """The coordinator waits for the other process's drain, and once that process is killed, no longer than the
    tier's timeout (not the update's drain timeout); the event says it did not acknowledge."""
    standin = engine(token_interval_ms=100, reply_tokens=40)  # a call of about 4 s
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    with serve(standin.app()) as engine_url, proxy(kafka, engine_url, "proxy-a") as a, \
            proxy_process(kafka, engine_url, "proxy-b", tmp_path / "proxy-b.log") as b:
        await tier_of(a, b)
        running = asyncio.create_task(chat(b.new_session(), stream=True))
        await until(lambda: _true(standin.requests >= 1))
        update = asyncio.create_task(push(a, str(checkpoint), "1", drain_timeout_s=60))
        await until(lambda: _both(a, b, "holding"), what="both gates closed")
        await asyncio.sleep(0.5)
        assert not update.done() and standin.loaded_paths == []  # waiting for b's drain
        b.kill()
        killed = time.monotonic()
        answer = await update
        waited_s = time.monotonic() - killed
        assert answer.status_code == 200, answer.text
        assert waited_s < TIER_TIMEOUT_S + 3, waited_s
        assert standin.loaded_paths == [str(checkpoint)] and standin.weight_version == "1"
        await running
        assert (await policy(a))["tier"] == ["proxy-a"]
    events = await policy_log(kafka, 1)
    [pushed] = [e for e in events if isinstance(e, WeightsUpdated)]
    parts = {part.instance: part for part in pushed.proxies}
    assert parts["proxy-a"].status == "drained"
    assert parts["proxy-b"].status == "absent" and "not heard from" in (parts["proxy-b"].error or "")
    assert ("drained", "proxy-b") not in gates(events, pushed.update_id)


async def test_a_proxy_started_during_an_update_holds_its_calls_until_it_ends(kafka: KafkaSettings,
                                                                             tmp_path: Path) -> None:
    """A process that starts while the engine loads learns of the update from the log: its calls wait (rather
    than reach the paused engine and be stamped with the old version), and it refuses a second push."""
    standin = engine(reload_ms=4000)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    with serve(standin.app()) as engine_url, proxy(kafka, engine_url, "proxy-a") as a:
        await tier_of(a)
        update = asyncio.create_task(push(a, str(checkpoint), "1"))
        await until(lambda: paused(engine_url), what="the engine paused")
        with proxy(kafka, engine_url, "proxy-c") as c:
            await until(lambda: _updating(c), what="the new process learned of the update")
            assert (await policy(c))["holding"]
            session = c.new_session()
            call = asyncio.create_task(chat(session))
            await until(lambda: _held(c), what="the call held on the new process")
            refused = await push(c, str(checkpoint), "2")
            assert refused.status_code == 409 and "in progress" in refused.json()["detail"], refused.text
            assert not update.done()
            answer = await update
            ended = time.monotonic()
            assert answer.status_code == 200, answer.text
            response, _, finished = await call
            assert response is not None and response.status_code == 200, response
            assert finished >= ended - 0.5
            [completion] = await c.completions(1)
            assert completion.policy_version == "1" and completion.status == "ok"
            assert (await policy(c))["version"] == "1"


async def test_a_coordinator_killed_mid_update_leaves_no_gate_closed(kafka: KafkaSettings, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The other process reopens once the coordinator is silent for the tier's timeout, and says why; a new push
    to it brings the engine back to one version."""
    caplog.set_level(logging.WARNING, logger="proxy.policy_tier")
    standin = engine(reload_ms=3000)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    with serve(standin.app()) as engine_url, proxy(kafka, engine_url, "proxy-a") as a, \
            proxy_process(kafka, engine_url, "proxy-b", tmp_path / "proxy-b.log") as b:
        await tier_of(a, b)
        update = asyncio.create_task(push(b, str(checkpoint), "1"))
        await until(lambda: paused(engine_url), what="the engine paused")
        assert (await policy(a))["holding"]
        b.kill()
        killed = time.monotonic()
        try:
            lost: httpx.Response | None = await update
        except httpx.HTTPError:
            lost = None
        assert lost is None or lost.status_code != 200
        await until(lambda: _not_holding(a), timeout_s=TIER_TIMEOUT_S + 5, what="a's gate reopened")
        assert time.monotonic() - killed < TIER_TIMEOUT_S + 5
        assert any("reopening this proxy's gate without the update's end" in r.getMessage()
                   and "proxy-b has not been heard from" in r.getMessage() for r in caplog.records), caplog.text
        answer = await push(a, str(checkpoint), "2")
        assert answer.status_code == 200, answer.text
        assert answer.json()["version"] == "2" and standin.weight_version == "2"
        assert not await paused(engine_url)
        response, _, _ = await chat(a.new_session())
        assert response is not None and response.status_code == 200
        [completion] = await a.completions(1)
        assert completion.policy_version == "2"


async def test_two_pushes_to_two_proxies_at_once_run_one_at_a_time(kafka: KafkaSettings, tmp_path: Path) -> None:
    standin = engine(reload_ms=1000)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    with serve(standin.app()) as engine_url, proxy(kafka, engine_url, "proxy-a") as a, \
            proxy(kafka, engine_url, "proxy-b") as b:
        await tier_of(a, b)
        answers = await asyncio.gather(push(a, str(checkpoint), "1"), push(b, str(checkpoint), "1"))
        assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
        assert "in progress" in next(r for r in answers if r.status_code == 409).json()["detail"]
        assert standin.loaded_paths == [str(checkpoint)]
        for p in (a, b):
            await until(lambda p=p: _not_holding(p), what="gates open")
            assert (await policy(p))["version"] == "1"
    events = await policy_log(kafka, 1)
    assert sum(isinstance(e, WeightsUpdated) for e in events) == 1
    withdrawn = [e for e in events if isinstance(e, TierGate) and e.phase == "open" and e.status == "withdrawn"]
    closes = [e for e in events if isinstance(e, TierGate) and e.phase == "close"]
    assert len(closes) == 1 + len(withdrawn)  # a losing close, when written, is withdrawn


def test_a_push_event_of_schema_version_1_still_reads() -> None:
    """Events written before the tier (schema version 1, no ``proxies``) stay readable on the kept topic."""
    from schemas.codec import decode_event
    from schemas.topics import TopicRegistry

    record = (b'{"event_type": "policy.weights_updated", "schema_version": 1, "event_id": "e1", '
              b'"occurred_at": "2026-01-01T00:00:00Z", "served_model": "m", "version": "3", "paused_ms": 12.5, '
              b'"held_calls": 2, "drained_calls": 1}')
    event = decode_event(record, TopicRegistry().spec(Topic.POLICY))
    assert isinstance(event, WeightsUpdated) and event.schema_version == 1
    assert event.proxies == [] and event.update_id is None and event.held_calls == 2


# ---- small predicates ------------------------------------------------------------------------------------------


async def _true(value: bool) -> bool:
    return value


async def _both(a: ProxyUnderTest, b: ProxyUnderTest, field: str) -> bool:
    return bool((await policy(a))[field]) and bool((await policy(b))[field])


async def _updating(p: ProxyUnderTest) -> bool:
    return bool((await policy(p))["updating"])


async def _held(p: ProxyUnderTest) -> bool:
    return (await policy(p))["held_calls"] >= 1


async def _not_holding(p: ProxyUnderTest) -> bool:
    return not (await policy(p))["holding"]
