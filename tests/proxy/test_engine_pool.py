"""The engine pool without real engines: which engines a configuration names (and which it refuses), where
placement sends a call, a pool whose engines serve different models refused at start, a weight step
sent again when the engine closed its connection, and a pool whose engines are all down answering the
provider's 503, recorded, until an engine is back.

The placement cases are pure functions over loads; the model check runs against stand-in engines on real
sockets; the all-down case through a real proxy on the real broker."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.errors import WeightUpdateFailed
from proxy.fleet.entries import EngineEntry, PoolConfigError, configured_entries, parse_entries
from proxy.fleet.placement import Load, choose, least_loaded, pin_is_full, rendezvous
from proxy.fleet.pool import EnginePool
from proxy.settings import ProxySettings
from proxy.weight_api import WeightApi
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import free_port, serve
from tests.support.standin_engine import Standin, StandinConfig, create_app as create_standin

MESSAGES = [{"role": "user", "content": "hi"}]


# ---- entries ----------------------------------------------------------------------------------------


def test_entries_parse_urls_and_names() -> None:
    entries = parse_entries(" a=http://127.0.0.1:18000/ , http://10.0.0.2:8000\n# a comment\n"
                            "b=https://b.example:443  # the third", "test")
    assert entries == [EngineEntry("a", "http://127.0.0.1:18000"),
                       EngineEntry("http://10.0.0.2:8000", "http://10.0.0.2:8000"),
                       EngineEntry("b", "https://b.example:443")]
    # An '=' in the URL's query is not a name.
    assert parse_entries("http://h:1/v?x=1", "test") == [EngineEntry("http://h:1/v?x=1", "http://h:1/v?x=1")]


@pytest.mark.parametrize("text, fragment", [
    ("", "names no engine"),
    (" , \n# only a comment\n", "names no engine"),
    ("127.0.0.1:18000", "is not an engine URL"),
    ("a=127.0.0.1:18000", "is not an engine URL"),
    ("ftp://h:1", "is not an engine URL"),
    ("http://", "is not an engine URL"),
    ("http://h:port", "malformed port"),
    ("a=http://h:1,a=http://h:2", "named twice"),
    ("http://h:1,http://h:1/", "named twice"),  # the same URL twice is the same id
])
def test_bad_pools_are_refused_with_the_reason(text: str, fragment: str) -> None:
    with pytest.raises(PoolConfigError, match=fragment) as raised:
        parse_entries(text, "ROLLWIRE_ENGINE_URLS")
    assert raised.value.message.startswith("ROLLWIRE_ENGINE_URLS")  # says which setting to fix


def test_the_pool_file_comes_first_then_the_urls_then_the_one_engine(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.write_text("x=http://x:1\ny=http://y:2\n")
    assert [e.id for e in configured_entries("http://one:1", "a=http://a:1", str(pool))] == ["x", "y"]
    assert [e.id for e in configured_entries("http://one:1", "a=http://a:1", None)] == ["a"]
    assert [e.id for e in configured_entries("http://one:1", None, None)] == ["http://one:1"]
    with pytest.raises(PoolConfigError, match="cannot be read"):
        configured_entries("http://one:1", None, str(tmp_path / "missing"))
    with pytest.raises(PoolConfigError, match="names no engine"):
        EnginePool(ProxySettings(engine_urls=" , "))  # the proxy refuses it when it is made


# ---- placement --------------------------------------------------------------------------------------


def loads(**in_flight: int) -> list[Load]:
    return [Load(engine, True, n) for engine, n in in_flight.items()]


def test_least_loaded_ties_rotate_and_the_unhealthy_get_nothing() -> None:
    tied = loads(a=1, b=1, c=1)
    assert {least_loaded(tied, turn) for turn in range(3)} == {"a", "b", "c"}
    assert least_loaded(loads(a=2, b=0, c=1), 7) == "b"
    assert least_loaded([Load("a", False, 0), Load("b", True, 5)], 0) == "b"
    assert least_loaded([Load("a", False, 0)], 0) is None
    assert least_loaded([], 0) is None
    # New branches on an idle pool spread over it rather than all landing on the first engine.
    firsts = Counter(choose("sticky_least_loaded", loads(a=0, b=0), pinned=None, session_id=f"s{i}", cap=4,
                            turn=i) for i in range(10))
    assert firsts == {"a": 5, "b": 5}


def test_sticky_stays_under_its_cap_and_moves_over_it() -> None:
    pool = loads(a=3, b=0)
    # Pinned to the busier engine, under its cap: the branch stays where its prefix is cached.
    assert choose("sticky_least_loaded", pool, pinned="a", session_id="s", cap=4, turn=0) == "a"
    assert not pin_is_full(pool, "a", 4)
    # At its cap: worth a wait first, then the least-loaded engine.
    assert pin_is_full(pool, "a", 3)
    assert choose("sticky_least_loaded", pool, pinned="a", session_id="s", cap=3, turn=0) == "b"
    # At its cap with nowhere else to go (one engine; every other full or down): it stays, without a wait.
    assert not pin_is_full([Load("a", True, 3)], "a", 3)
    assert choose("sticky_least_loaded", [Load("a", True, 3)], pinned="a", session_id="s", cap=3, turn=0) == "a"
    crowded = [Load("a", True, 5), Load("b", True, 3), Load("c", False, 0)]
    assert not pin_is_full(crowded, "a", 3)
    assert choose("sticky_least_loaded", crowded, pinned="a", session_id="s", cap=3, turn=0) == "a"
    # Unhealthy or gone from the pool: moved at once, never a wait.
    sick = [Load("a", False, 0), Load("b", True, 2)]
    assert not pin_is_full(sick, "a", 1)
    assert choose("sticky_least_loaded", sick, pinned="a", session_id="s", cap=4, turn=0) == "b"
    assert choose("sticky_least_loaded", pool, pinned="gone", session_id="s", cap=4, turn=0) == "b"
    assert choose("sticky_least_loaded", [Load("a", False, 0)], pinned="a", session_id="s", cap=4, turn=0) is None


def test_consistent_hash_is_stable_and_moves_only_the_lost_engines_sessions() -> None:
    three = loads(a=0, b=9, c=0)
    sessions = [f"session-{i}" for i in range(60)]
    first = {s: rendezvous(three, s) for s in sessions}
    assert first == {s: rendezvous(loads(c=5, a=1, b=0), s) for s in sessions}  # whatever the load or order
    assert set(first.values()) == {"a", "b", "c"}
    assert all(choose("consistent_hash", three, pinned="c", session_id=s, cap=1, turn=i) == first[s]
               for i, s in enumerate(sessions))  # blind to pins and caps, as plain hashing is
    without_b = [Load("a", True, 0), Load("b", False, 0), Load("c", True, 0)]
    after = {s: rendezvous(without_b, s) for s in sessions}
    assert all(after[s] == first[s] for s in sessions if first[s] != "b")
    assert {after[s] for s in sessions if first[s] == "b"} <= {"a", "c"}


def test_round_robin_goes_round_the_healthy_engines() -> None:
    pool = [Load("a", True, 0), Load("b", False, 0), Load("c", True, 9)]
    assert [choose("round_robin", pool, pinned="a", session_id="s", cap=1, turn=t) for t in range(4)] == \
        ["a", "c", "a", "c"]


# ---- a pool serving two models is refused at start ----------------------------------------------------


async def test_an_engine_serving_another_model_is_refused_at_start() -> None:
    with serve(create_standin(StandinConfig(model="rollwire-tiny"))) as a, \
            serve(create_standin(StandinConfig(model="someone-elses-model"))) as b:
        urls = f"a={a},b={b}"
        pool = EnginePool(ProxySettings(engine_urls=urls))
        try:
            with pytest.raises(PoolConfigError, match="serve different models") as raised:
                await pool.start()
            assert "a: rollwire-tiny" in raised.value.message and "b: someone-elses-model" in raised.value.message
        finally:
            await pool.stop()
        # With the model named, the engine that does not list it is named (the check once took the configured
        # name for every engine's own, and refused none).
        pool = EnginePool(ProxySettings(engine_urls=urls, served_model="rollwire-tiny"))
        try:
            with pytest.raises(PoolConfigError, match=r"engines b do not serve 'rollwire-tiny'"):
                await pool.start()
        finally:
            await pool.stop()
        same = EnginePool(ProxySettings(engine_urls=f"a={a},c={a}"))
        try:
            await same.start()  # one model: fine
            assert [state["healthy"] for state in same.states()] == [True, True]
        finally:
            await same.stop()


async def test_the_pool_file_is_read_again_while_the_proxy_runs(tmp_path: Path) -> None:
    """An engine added to the pool file joins (healthy once its check passes); one taken out leaves once it
    has no call in flight; a malformed file is not applied and the pool goes on as it was."""
    with serve(create_standin(StandinConfig())) as a, serve(create_standin(StandinConfig())) as b:
        pool_file = tmp_path / "pool"
        pool_file.write_text(f"a={a}\n")
        pool = EnginePool(ProxySettings(engine_pool_file=str(pool_file), engine_health_interval_s=0.1))
        try:
            await pool.start()
            assert [s["id"] for s in pool.states()] == ["a"]
            pool_file.write_text(f"# the pool grows\na={a}\nb={b}\n")
            deadline = time.monotonic() + 20
            while not any(s["id"] == "b" and s["healthy"] for s in pool.states()):
                assert time.monotonic() < deadline, pool.states()
                await asyncio.sleep(0.1)
            busy = await pool.acquire(None, "s1")  # a call in flight on whichever engine it went to
            pool_file.write_text("not a url\n")
            await asyncio.sleep(0.5)
            assert {s["id"] for s in pool.states()} == {"a", "b"}  # the malformed file changed nothing
            keep = "b" if busy.id == "a" else "a"
            pool_file.write_text(f"{keep}={b if keep == 'b' else a}\n")
            deadline = time.monotonic() + 20
            while any(s["id"] == busy.id and s["healthy"] for s in pool.states()):
                assert time.monotonic() < deadline, pool.states()
                await asyncio.sleep(0.1)
            assert busy.id in {s["id"] for s in pool.states()}  # still there while its call runs
            pool.release(busy)
            deadline = time.monotonic() + 20
            while busy.id in {s["id"] for s in pool.states()}:
                assert time.monotonic() < deadline, pool.states()
                await asyncio.sleep(0.1)
            assert [s["id"] for s in pool.states()] == [keep]
        finally:
            await pool.stop()


# ---- a weight step on a connection the engine closed ---------------------------------------------------


async def test_a_weight_step_whose_connection_the_engine_closed_is_sent_again() -> None:
    """vLLM closes its connection after a failed ``/collective_rpc``: the rollback's reload, sent at once on that
    connection, met "Server disconnected" and the engine was resumed half-loaded (the real case:
    tests/proxy/test_engine_pool_vllm.py). A step that gets no answer is sent once more; a second break fails."""
    seen: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if len(seen) in (1, 3, 4):
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json={"results": [None]})

    async with httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(engine)) as client:
        weights = WeightApi(client, timeout_s=5)
        await weights.reload_weights("/ckpt/step-1")
        assert seen == ["/collective_rpc", "/collective_rpc"]
        with pytest.raises(WeightUpdateFailed, match="disconnected"):
            await weights.resume()
        assert seen[2:] == ["/resume", "/resume"]


# ---- all engines down ---------------------------------------------------------------------------------


@pytest.mark.kafka
async def test_all_engines_down_is_503_recorded_and_recovers_by_itself(kafka: KafkaSettings) -> None:
    ports = free_port(), free_port()
    settings = proxy_settings("http://127.0.0.1:1", engine_urls=",".join(
        f"e{i}=http://127.0.0.1:{port}" for i, port in enumerate(ports)), engine_health_interval_s=0.2)
    with serve(create_app(settings, kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        chat = f"{session['base_urls']['openai']}/chat/completions"
        for stream in (False, True):
            response = httpx.post(chat, json={"messages": MESSAGES, "stream": stream}, headers=auth(session),
                                  timeout=30)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "server_error" and "cannot be reached" in error["message"], error
        states = httpx.get(f"{url}/v1/engines", timeout=10).json()
        assert [s["healthy"] for s in states] == [False, False]
        # The second engine comes back: the pool finds it without a restart, and calls are served there.
        with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=8)), port=ports[1]):
            deadline = time.monotonic() + 20
            while not httpx.get(f"{url}/v1/engines", timeout=10).json()[1]["healthy"]:
                assert time.monotonic() < deadline, "the engine that came back did not rejoin"
                time.sleep(0.1)
            response = httpx.post(chat, json={"messages": MESSAGES}, headers=auth(session), timeout=30)
            assert response.status_code == 200, response.text
        failed_whole, failed_stream, served = await proxy.completions(3, timeout_s=30)
    for failed in (failed_whole, failed_stream):
        assert failed.status == "error" and failed.error is not None
        assert failed.error.kind == "engine_unavailable" and failed.error.http_status == 503
    assert served.status == "ok" and served.engine == "e1"


async def test_a_full_pin_with_nowhere_else_to_go_serves_at_once() -> None:
    """One engine at its cap: a pinned call does not sit out the pin wait only to land where it was."""
    with serve(create_standin(StandinConfig())) as url:
        pool = EnginePool(ProxySettings(engine_urls=f"solo={url}", engine_max_in_flight=1, engine_pin_wait_s=5.0))
        await pool.start()
        try:
            first = await pool.acquire(None, "s")
            started = time.monotonic()
            second = await pool.acquire("solo", "s")
            assert second is first and time.monotonic() - started < 1.0
            pool.release(second)
            pool.release(first)
        finally:
            await pool.stop()


# ---- an engine too busy loading to answer its health check ------------------------------------------------


@pytest.mark.kafka
async def test_an_engine_unhealthy_while_loading_is_updated_rolled_back_and_resumed_with_the_others(
        kafka: KafkaSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An engine whose /health does not answer while it loads leaves the rotation in the middle of the
    update; it stays part of the update all the same. Dropped from it, it would get neither the new version
    nor its resume (after a failed update: neither its rollback nor its resume), and every call placed on it
    once it came back would wait on a paused engine."""
    steady = Standin(StandinConfig(latency_ms=1, reply_tokens=8, dev_mode=True, reload_ms=600))
    busy = Standin(StandinConfig(latency_ms=1, reply_tokens=8, dev_mode=True, reload_ms=600,
                                 unhealthy_while_reloading=True))
    step_1, step_2 = tmp_path / "step-1", tmp_path / "step-2"
    step_1.mkdir()
    step_2.mkdir()
    busy.unmounted.add(str(step_2))
    with serve(steady.app()) as steady_url, serve(busy.app()) as busy_url:
        settings = proxy_settings(steady_url, engine_urls=f"e0={steady_url},e1={busy_url}",
                                  engine_placement="round_robin", engine_health_interval_s=0.05)
        with serve(create_app(settings, kafka)) as url:
            proxy = ProxyUnderTest(url, kafka)

            async def served_by_both() -> None:
                deadline = time.monotonic() + 20
                while not all(s["healthy"] for s in httpx.get(f"{url}/v1/engines", timeout=10).json()):
                    assert time.monotonic() < deadline, "the busy engine did not come back"
                    await asyncio.sleep(0.05)
                before = steady.requests, busy.requests
                async with httpx.AsyncClient(timeout=10) as client:  # a paused engine would never answer
                    for _ in range(4):
                        session = proxy.new_session()
                        reply = await client.post(f"{session['base_urls']['openai']}/chat/completions",
                                                  headers=auth(session), json={"messages": MESSAGES})
                        assert reply.status_code == 200, reply.text
                assert steady.requests > before[0] and busy.requests > before[1]

            caplog.set_level("WARNING", logger="proxy.fleet.pool")
            answer = httpx.post(f"{url}/v1/policy/weights", json={"weights_path": str(step_1), "version": "1"},
                                timeout=60)
            assert answer.status_code == 200, answer.text
            assert "engine e1 leaves the pool's rotation" in caplog.text  # the case under test happened
            assert (steady.weight_version, busy.weight_version) == ("1", "1")
            assert steady.loaded_paths == busy.loaded_paths == [str(step_1)]
            assert not any(json_of(engine_url, "/is_paused")["is_paused"] for engine_url in (steady_url, busy_url))
            await served_by_both()

            caplog.clear()
            failed = httpx.post(f"{url}/v1/policy/weights", json={"weights_path": str(step_2), "version": "2"},
                                timeout=60)
            assert failed.status_code == 502 and "e1" in failed.json()["detail"], failed.text
            assert "engine e1 leaves the pool's rotation" in caplog.text
            assert (steady.weight_version, busy.weight_version) == ("1", "1")
            assert steady.loaded_paths == [str(step_1), str(step_2), str(step_1)]  # rolled back
            assert busy.loaded_paths == [str(step_1), str(step_1)] and not busy.broken  # restored after its failure
            assert not any(json_of(engine_url, "/is_paused")["is_paused"] for engine_url in (steady_url, busy_url))
            await served_by_both()


def json_of(url: str, path: str) -> dict:
    return httpx.get(f"{url}{path}", timeout=10).json()
