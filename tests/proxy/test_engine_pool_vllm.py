"""The engine pool on two real vLLM CPU engines (the ``vllm_engines`` fixture), through a real proxy on the
real broker.

Weights: an update through the proxy reaches both engines, whose logprobs are then transformers' over the
new checkpoint; an update that one engine fails (a host that cannot see the checkpoint: the real engine is
asked to load a folder it does not have) leaves both on the previous version, with the previous weights
really back in the engine that had loaded the new ones, and the gate open. vLLM closes its connection after
a failed load: the rollback's reload must go out on a new one, or the engine is resumed half-loaded and dies
at its next call.

Failover: an engine SIGKILLed between the calls of several exact-token sessions costs none of them: every
next call is served by the other engine, continuing its branch from its exact tokens (one trace per branch);
an update made while it is down reaches it when it is restarted, before it serves again.

The engines are shared by the whole test run: each test puts their original weights and version back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from processors.builders import SessionFacts, build_trajectory
from proxy.app import create_app
from schemas.completions import Completion
from schemas.policy import WeightsUpdated
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.conftest import PoolEngine
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.proxy.test_weight_sync_vllm import TOLERANCE, checkpoint, restore_engine, score
from tests.servers import serve

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(1800)]

SYSTEM = {"role": "system", "content": "You are a coding agent."}
NAMES = ("engine-0", "engine-1")


# ---- the engines: their weights, put back after each test -------------------------------------------


def weight_version(url: str) -> str:
    return httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]


def served_folder(url: str) -> Path:
    return Path(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["root"])


@pytest.fixture
def engines(vllm_engines: list[PoolEngine], tmp_path: Path) -> Iterator[list[PoolEngine]]:
    """Both engines, dev mode checked; afterwards both run again (a test may have killed one) and serve
    the original weights as version ``default``."""
    for engine in vllm_engines:
        if httpx.get(f"{engine.url}/weight_info", timeout=30).status_code == 404:
            pytest.skip(f"{engine.url} was started without VLLM_SERVER_DEV_MODE=1 (reused through "
                        "ROLLWIRE_TEST_ENGINE_URLS?): its weight endpoints are missing")
    original = checkpoint(served_folder(vllm_engines[0].url), tmp_path / "original", None)
    try:
        yield vllm_engines
    finally:
        for engine in vllm_engines:
            if engine.server is not None and not engine.server.is_ready():
                engine.server.start(timeout_s=1800)
            restore_engine(engine.url, original)


@contextmanager
def pool_proxy(kafka: KafkaSettings, urls: list[str], **overrides: Any) -> Iterator[ProxyUnderTest]:
    pool = ",".join(f"{name}={url}" for name, url in zip(NAMES, urls, strict=True))
    values: dict[str, Any] = dict(engine_urls=pool, engine_timeout_s=300, weight_update_timeout_s=300,
                                  engine_health_interval_s=0.5)
    settings = proxy_settings(urls[0], **(values | overrides))
    with serve(create_app(settings, kafka)) as url:
        yield ProxyUnderTest(url, kafka)


def update(proxy: ProxyUnderTest, folder: Path, version: str) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/policy/weights", timeout=600,
                      json={"weights_path": str(folder), "version": version})


async def policy_events(kafka: KafkaSettings, want: int) -> list[WeightsUpdated]:
    got: list[WeightsUpdated] = []
    async with EventConsumer(kafka, [Topic.POLICY], group_id=None, dead_letters=False) as consumer:
        deadline = time.monotonic() + 30
        while len(got) < want and time.monotonic() < deadline:
            got.extend(r.event for r in await consumer.getmany(timeout_ms=500) if isinstance(r.event, WeightsUpdated))
    return got


async def chat(session: dict, messages: list[dict[str, Any]]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        response = await client.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                                     json={"model": "m", "messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def by_engine(events: list[Completion]) -> dict[str | None, list[Completion]]:
    grouped: dict[str | None, list[Completion]] = {}
    for event in events:
        grouped.setdefault(event.engine, []).append(event)
    return grouped


def logprob_gap(events: list[Completion], scored: list[list[float]]) -> float:
    """The largest difference between the engine's logprobs of ``events`` and ``scored`` (the same calls)."""
    return max(float(np.abs(np.array(e.logprobs.tolist()) - np.array(s)).max()) for e, s in zip(events, scored,
                                                                                                 strict=True))


# ---- a host of the pool that cannot see a checkpoint ------------------------------------------------


class Unmounted:
    """A real engine on a host without some checkpoint folders: a plain TCP relay in front of the engine
    that, in the requests it carries, turns a folder named in ``missing`` into one of the same length that
    does not exist, so that the engine itself fails to load it (as on a host where the trainer's folder is
    not mounted). Being TCP, its connections answer, break and close as the engine's own do."""

    def __init__(self, engine_url: str) -> None:
        address = urlsplit(engine_url)
        assert address.hostname is not None and address.port is not None
        self.engine = (address.hostname, address.port)
        self.missing: set[str] = set()
        self.refused: list[str] = []

    def _rewrite(self, data: bytes) -> bytes:
        for folder in self.missing:
            if folder.encode() in data:
                self.refused.append(folder)
                data = data.replace(folder.encode(), folder.encode()[:-1] + b"_")
        return data

    async def _connection(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            engine_in, engine_out = await asyncio.open_connection(*self.engine)
        except OSError:
            client_out.transport.abort()
            return

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, rewrite: bool) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(self._rewrite(data) if rewrite else data)
                    await sink.drain()
            except OSError:
                pass
            finally:  # one side gone: so is the other
                client_out.close()
                engine_out.close()

        await asyncio.gather(pipe(client_in, engine_out, True), pipe(engine_in, client_out, False))

    @contextmanager
    def running(self) -> Iterator[str]:
        """The relay on a free port of its own thread's loop (the test's loop may block on a sync call)."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        port: list[int] = []

        def serve_forever() -> None:
            asyncio.set_event_loop(loop)
            server = loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
            port.append(server.sockets[0].getsockname()[1])
            ready.set()
            loop.run_forever()

        thread = threading.Thread(target=serve_forever, daemon=True)
        thread.start()
        assert ready.wait(30), "the relay did not start"
        try:
            yield f"http://127.0.0.1:{port[0]}"
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


# ---- weights reach every engine, all or none ----------------------------------------------------------


async def new_calls(proxy: ProxyUnderTest, count: int, seed: int) -> None:
    """``count`` one-call sessions, one after another (round-robin puts them on both engines)."""
    for i in range(count):
        session = proxy.new_session(engine={"seed": seed + i, "temperature": 1.0, "max_tokens": 10})
        await chat(session, [SYSTEM, {"role": "user", "content": f"Fix test number {seed + i}."}])


async def test_weight_update_reaches_both_engines_and_a_failure_on_one_leaves_both_as_they_were(
        engines: list[PoolEngine], kafka: KafkaSettings, tmp_path: Path) -> None:
    direct, behind = (engine.url for engine in engines)
    folder = served_folder(direct)
    step_1 = checkpoint(folder, tmp_path / "step-1", seed=1)
    step_2 = checkpoint(folder, tmp_path / "step-2", seed=2)
    host = Unmounted(behind)
    with host.running() as behind_relay, \
            pool_proxy(kafka, [direct, behind_relay], engine_placement="round_robin") as proxy:
        assert httpx.get(f"{proxy.url}/v1/policy", timeout=30).json()["version"] == "0"
        answer = update(proxy, step_1, "1")
        assert answer.status_code == 200, answer.text
        assert answer.json()["version"] == "1"
        assert [weight_version(direct), weight_version(behind)] == ["1", "1"]
        await new_calls(proxy, 4, seed=10)

        # The second engine's host cannot see step-2: its real engine fails the load, so the update fails as
        # a whole and both engines get step-1 back (the first had loaded step-2 already).
        host.missing.add(str(step_2))
        failed = update(proxy, step_2, "2")
        assert failed.status_code == 502, failed.text
        assert "engine-1" in failed.json()["detail"] and "loading the weights" in failed.json()["detail"]
        assert host.refused == [str(step_2)]
        assert [weight_version(direct), weight_version(behind)] == ["1", "1"]
        policy = httpx.get(f"{proxy.url}/v1/policy", timeout=30).json()
        assert (policy["version"], policy["updating"], policy["holding"]) == ("1", False, False)
        assert all(state["healthy"] and state["version"] == "1"
                   for state in httpx.get(f"{proxy.url}/v1/engines", timeout=30).json())
        await new_calls(proxy, 4, seed=20)  # the gate is open: served, by both engines
        events = await proxy.completions(8, timeout_s=60)

    ok, rolled_back = await policy_events(kafka, 2)
    assert (ok.status, ok.version, ok.previous_version) == ("ok", "1", "0")
    assert sorted((e.engine, e.status) for e in ok.engines) == [("engine-0", "ok"), ("engine-1", "ok")]
    assert (rolled_back.status, rolled_back.version) == ("failed", "1")
    parts = {e.engine: e for e in rolled_back.engines}
    assert (parts["engine-0"].status, parts["engine-1"].status) == ("rolled_back", "failed")
    assert "loading the weights" in (parts["engine-1"].error or "")

    assert all(e.status == "ok" and e.policy_version == "1" for e in events)
    grouped = by_engine(events)
    assert {name: len(calls) for name, calls in grouped.items()} == {"engine-0": 4, "engine-1": 4}
    scored = await asyncio.to_thread(score, {"step-1": str(step_1), "step-2": str(step_2)},
                                     [(e.prompt_token_ids.tolist(), e.token_ids.tolist()) for e in events])
    by_call = {id(e): i for i, e in enumerate(events)}
    for name, calls in grouped.items():
        on_step_1 = [scored["step-1"][by_call[id(e)]] for e in calls]
        on_step_2 = [scored["step-2"][by_call[id(e)]] for e in calls]
        print(f"{name}: |engine - transformers(step-1)| ≤ {logprob_gap(calls, on_step_1):.2e} over "
              f"{sum(len(e.token_ids) for e in calls)} tokens; step-2 would differ by "
              f"{logprob_gap(calls, on_step_2):.2e}")
        assert logprob_gap(calls, on_step_1) <= TOLERANCE, name  # before and after the failed update
        assert logprob_gap(calls, on_step_2) > 100 * TOLERANCE, name  # step-2 really is gone again


# ---- an engine killed mid-session ---------------------------------------------------------------------


def kill(engine: PoolEngine) -> None:
    """SIGKILL the engine's whole process group (API server and engine core): no clean shutdown."""
    assert engine.server is not None
    pid = engine.server.pid()
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{engine.url}/health", timeout=2)
        except httpx.HTTPError:
            return
        assert time.monotonic() < deadline, "the killed engine still answers"
        time.sleep(0.2)


def engine_states(proxy: ProxyUnderTest) -> dict[str, dict[str, Any]]:
    return {state["id"]: state for state in httpx.get(f"{proxy.url}/v1/engines", timeout=30).json()}


def extends(child: Completion, parent: Completion) -> bool:
    """The child's prompt starts with the parent's prompt + sampled ids."""
    whole = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()
    return child.prompt_token_ids.tolist()[:len(whole)] == whole


class Agent:
    """One exact-token session: keeps its conversation and sends it whole each turn, as a harness does."""

    def __init__(self, proxy: ProxyUnderTest, index: int) -> None:
        self.session = proxy.new_session(engine={"continuation": "exact", "seed": 100 + index,
                                                 "temperature": 1.0, "max_tokens": 8})
        self.id = self.session["session_id"]
        self.messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"Fix bug {index} in app.py."}]

    async def turn(self, n: int) -> None:
        reply = await chat(self.session, self.messages)
        self.messages += [{"role": "assistant", "content": reply.get("content") or ""},
                          {"role": "user", "content": f"The tests still fail ({n}). Go on."}]


async def test_a_killed_engine_costs_no_session_and_rejoins_at_the_current_version(
        engines: list[PoolEngine], kafka: KafkaSettings, tmp_path: Path) -> None:
    if any(engine.server is None for engine in engines):
        pytest.skip("the engines are reused (ROLLWIRE_TEST_ENGINE_URLS): this run cannot kill and restart one")
    urls = [engine.url for engine in engines]
    step_1 = checkpoint(served_folder(urls[0]), tmp_path / "step-1", seed=1)
    # Health read every 20 s: the calls right after the kill find the engine dead themselves (the passive
    # check), before an active check could.
    with pool_proxy(kafka, urls, engine_health_interval_s=20) as proxy:
        agents = [Agent(proxy, i) for i in range(4)]

        async def everyone(n: int) -> None:
            await asyncio.gather(*(agent.turn(n) for agent in agents))

        await everyone(0)
        await everyone(1)
        before = await proxy.completions(8, timeout_s=60)
        pins = {e.session_id: e.engine for e in before if e.sequence == 1}
        assert all(e.engine == pins[e.session_id] for e in before), "a session moved while its engine served"
        assert set(pins.values()) == set(NAMES), f"placement put every session on one engine: {pins}"
        victim_name = Counter(pins.values()).most_common(1)[0][0]
        victim = engines[NAMES.index(victim_name)]
        survivor = NAMES[1 - NAMES.index(victim_name)]
        pinned_to_victim = {session for session, engine in pins.items() if engine == victim_name}

        kill(victim)
        await everyone(2)  # the victim's sessions: refused there, served by the survivor as the same call
        await everyone(3)
        assert not engine_states(proxy)[victim_name]["healthy"]

        # An update while it is down reaches the survivor; the victim is brought to it when it comes back.
        answer = update(proxy, step_1, "1")
        assert answer.status_code == 200, answer.text
        assert weight_version(urls[NAMES.index(survivor)]) == "1"
        assert victim.server is not None
        await asyncio.to_thread(victim.server.start, 1800)  # the same port and home
        deadline = time.monotonic() + 300
        while not engine_states(proxy)[victim_name]["healthy"]:
            assert time.monotonic() < deadline, "the restarted engine did not rejoin the pool"
            await asyncio.sleep(0.5)
        assert engine_states(proxy)[victim_name]["version"] == "1"
        assert weight_version(victim.url) == "1"  # loaded before it was let back in
        await everyone(4)  # the moved sessions stay where their prefix is cached now
        newcomers = [Agent(proxy, 10), Agent(proxy, 11)]
        for newcomer in newcomers:  # one after another: the idle pool's tie goes round, one to each engine
            await newcomer.turn(0)
        events = await proxy.completions(22, timeout_s=60)

    sessions: dict[str, list[Completion]] = {}
    for event in events:
        sessions.setdefault(event.session_id, []).append(event)
    assert all(e.status == "ok" for e in events), [(e.session_id, e.sequence, e.error) for e in events]
    fresh = [sessions.pop(newcomer.id)[0] for newcomer in newcomers]
    assert sorted(e.engine or "" for e in fresh) == list(NAMES) and all(e.policy_version == "1" for e in fresh)
    on_victim = next(e for e in fresh if e.engine == victim_name)
    scored = await asyncio.to_thread(score, {"step-1": str(step_1)},
                                     [(on_victim.prompt_token_ids.tolist(), on_victim.token_ids.tolist())])
    assert logprob_gap([on_victim], scored["step-1"]) <= TOLERANCE  # it samples from step-1, not its own start
    for session_id, calls in sessions.items():
        assert [c.sequence for c in calls] == [0, 1, 2, 3, 4]  # no call lost, none asked twice
        after_kill = calls[2:]
        assert all(c.engine == survivor for c in after_kill), [(c.sequence, c.engine) for c in calls]
        for parent, child in zip(calls, calls[1:]):
            assert child.continuation is not None and child.continuation.mode == "exact", child.continuation
            assert extends(child, parent), (session_id, child.sequence)
        moved = calls[2]
        if session_id in pinned_to_victim:
            # Its first call after the kill was sent to the victim or, once the pool knew, straight elsewhere.
            assert moved.engine_attempts in (1, 2)
        else:
            assert moved.engine_attempts == 1
        assert [c.policy_version for c in calls] == ["0", "0", "0", "0", "1"]
        trajectory = build_trajectory("prefix_merging", calls, SessionFacts(session_id=session_id))
        assert trajectory.stats.branches == len(trajectory.traces) == 1, trajectory.stats
        [trace] = trajectory.traces
        last = calls[-1]
        assert trace.token_ids.tolist() == last.prompt_token_ids.tolist() + last.token_ids.tolist()
    attempts = [c.engine_attempts for c in events if c.session_id in pinned_to_victim and c.sequence == 2]
    assert 2 in attempts, "no call found the victim dead: the failover path was not exercised"
    print(f"sessions pinned to the killed engine: {len(pinned_to_victim)} of {len(agents)}; first calls after the "
          f"kill took {attempts} attempts; the restarted engine rejoined at version 1")


# ---- a whole rollout, an engine killed in the middle of it ---------------------------------------------

ROLLOUT_HARNESS = """
import json, sys, time, urllib.request
base_url, api_key, model = sys.argv[1:4]
messages = [{"role": "user", "content": "Tidy up this folder, one step at a time."}]
for turn in range(6):  # six model calls, each continuing the last exactly
    body = json.dumps({"model": model, "messages": messages}).encode()
    request = urllib.request.Request(base_url + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + api_key, "Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["message"]
    messages += [{"role": "assistant", "content": reply.get("content") or ""},
                 {"role": "user", "content": f"Step {turn} done. Next."}]
    time.sleep(0.5)
"""


def test_a_rollout_loses_no_session_to_an_engine_killed_mid_run(
        engines: list[PoolEngine], kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The main job on the pool (the `command` harness, six exact calls a session, four sessions): the engine
    with the most calls is SIGKILLed once a third of the calls are made. Every session completes, every call
    after the kill is served by the survivor and continues its branch exactly, each session builds one
    trace; the killed engine, restarted, is healthy in the pool again."""
    if any(engine.server is None for engine in engines):
        pytest.skip("the engines are reused (ROLLWIRE_TEST_ENGINE_URLS): this run cannot kill and restart one")
    from rich.console import Console

    from deploy import job as rollout_job
    from deploy.services import ServiceProcess
    from schemas.admin_token import admin_token
    from schemas.transport.admin import delete_topics
    from tests.servers import free_port

    script = tmp_path / "harness.py"
    script.write_text(ROLLOUT_HARNESS)
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("tidy me\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({
        "task_id": "pool", "instruction": "tidy up", "num_samples": 4, "timeout_s": 600,
        "engine": {"max_tokens": 6},
        "runtime": {"kind": "local", "repo": str(workdir)},
        "agent": {"harness": "command", "command": f"{sys.executable} {script} {{base_url}} {{api_key}} {{model}}"},
        "evaluator": {"name": "session_completed"}}) + "\n")
    proxy_port = free_port()
    pool = ",".join(f"{name}={engine.url}" for name, engine in zip(NAMES, engines, strict=True))
    for name, value in {"ROLLWIRE_HOME": str(tmp_path / "home"), "ROLLWIRE_KAFKA_BOOTSTRAP": kafka_bootstrap,
                        "ROLLWIRE_TOPIC_PREFIX": f"p{uuid.uuid4().hex[:8]}.", "ROLLWIRE_ENGINE_URLS": pool,
                        "ROLLWIRE_PROXY_PORT": str(proxy_port), "ROLLWIRE_PROCESSORS_PORT": str(free_port()),
                        "ROLLWIRE_PROCESSORS_STORE": "memory", "ROLLWIRE_ROLLOUT_PORT": str(free_port()),
                        "ROLLWIRE_GATEWAY_PORT": str(free_port()), "ROLLWIRE_GROUPS_PORT": str(free_port()),
                        "ROLLWIRE_GROUPS_STORE": "memory", "ROLLWIRE_SESSION_PARTITIONS": "2",
                        "ROLLWIRE_UI_PORT": str(free_port()), "ROLLWIRE_TASK_PARTITIONS": "1",
                        "ROLLWIRE_ENGINE_HEALTH_INTERVAL_S": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ROLLWIRE_ENGINE_URL", raising=False)
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    killed: list[str] = []

    def states() -> dict[str, dict[str, Any]]:
        token = admin_token()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return {s["id"]: s for s in httpx.get(f"{proxy_url}/v1/engines", headers=headers, timeout=10).json()}

    def killer() -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not killed:
            try:
                now = states()
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)
                continue
            if sum(int(s["calls"]) for s in now.values()) >= 8:
                victim = max(now, key=lambda engine_id: int(now[engine_id]["calls"]))
                kill(engines[NAMES.index(victim)])
                killed.append(victim)
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    console = Console(record=True, width=220, color_system=None)
    kafka = KafkaSettings()
    try:
        code = rollout_job.run_job(rollout_job.JobOptions(tasks_file=tasks, timeout_s=900, live=False), console)
        watcher.join(timeout=5)
        assert killed, "the engine was never killed: the rollout ended first"
        victim = engines[NAMES.index(killed[0])]
        assert victim.server is not None
        victim.server.start(timeout_s=1800)
        deadline = time.monotonic() + 120
        while not states()[killed[0]]["healthy"]:
            assert time.monotonic() < deadline, f"{killed[0]} did not rejoin the pool: {states()}"
            time.sleep(0.5)
        calls = asyncio.run(_completions(kafka))
    finally:
        for base_service in ("proxy", "processors", "ui"):
            ServiceProcess(name=base_service, args=(), health_url=None).stop()
        asyncio.run(delete_topics(kafka_bootstrap, kafka.topic_prefix))
    text = console.export_text()
    assert code == 0, text
    sessions: dict[str, list[Completion]] = {}
    for call in calls:
        sessions.setdefault(call.session_id, []).append(call)
    assert len(sessions) == 4 and all(len(c) == 6 for c in sessions.values()), {k: len(v) for k, v in sessions.items()}
    survivor = next(name for name in NAMES if name != killed[0])
    moved = 0
    for session_id, ordered in sessions.items():
        ordered.sort(key=lambda c: c.sequence)
        assert all(c.status == "ok" for c in ordered), [(c.sequence, c.error) for c in ordered]
        assert all(c.continuation is not None and c.continuation.mode == "exact" for c in ordered[1:]), \
            [(c.sequence, c.continuation) for c in ordered]
        served_by = [c.engine for c in ordered]
        if killed[0] in served_by:
            last_on_victim = max(i for i, engine in enumerate(served_by) if engine == killed[0])
            moved += int(last_on_victim < len(ordered) - 1)
            assert all(engine == survivor for engine in served_by[last_on_victim + 1:]), served_by
        trajectory = build_trajectory("prefix_merging", ordered, SessionFacts(session_id=session_id))
        assert len(trajectory.traces) == 1, (session_id, [t.sequences for t in trajectory.traces])
    assert moved >= 1, "no session was moved off the killed engine"


async def _completions(kafka: KafkaSettings, want: int = 24, timeout_s: float = 60) -> list[Completion]:
    """The run's completion events (prompt deltas resolved), read from the beginning of the topic."""
    from schemas.prompt_chain import resolve_session

    found: list[Completion] = []
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        deadline = time.monotonic() + timeout_s
        while len(found) < want and time.monotonic() < deadline:
            found.extend(r.event for r in await consumer.getmany(timeout_ms=1000) if isinstance(r.event, Completion))
    by_session: dict[str, list[Completion]] = {}
    for event in found:
        by_session.setdefault(event.session_id, []).append(event)
    return [call for events in by_session.values() for call in resolve_session(events).resolved]
