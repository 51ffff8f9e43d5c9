"""Several proxy processes behind HAProxy (deploy/proxy_front.py, ``stack.proxy_tier``), with the real
``haproxy`` binary (CI installs Debian's) and, for the tier, real ``rollwire proxy`` processes over the
stand-in engine and the test broker.

The front's rule (a session kept on one process, by the path's session id, else the key headers, else ``?key=``) is
checked on stand-in backends that name themselves; the tier's behaviour on the proxy processes: which
process served a call is read from each process's own ``/metrics`` (its count of model calls), and the
front's ``x-rollwire-proxy`` header must agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from deploy import proxy_front, stack
from deploy.cli import app
from deploy.proxy_front import Backend, FrontConfig
from proxy.settings import ProxySettings
from schemas.admin_token import admin_token
from schemas.transport.admin import delete_topics, ensure_topics
from schemas.transport.settings import KafkaSettings
from tests.servers import free_port, serve
from tests.support.proxy_tier import proxy_tier
from tests.support.standin_engine import StandinConfig
from tests.support.standin_engine import create_app as create_standin

HAPROXY = shutil.which("haproxy")  # never skipped for want of it: CI installs it (.ci/run)
TOKENS, TOKEN_MS = 8, 40  # the stand-in's replies: 8 tokens, one every 40 ms


def _front_config(backends: tuple[Backend, ...], port: int, stats_port: int) -> FrontConfig:
    return FrontConfig(host="127.0.0.1", port=port, stats_port=stats_port, backends=backends, server_timeout_s=60)


def _wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _server_states(stats_url: str) -> dict[str, str]:
    """Each proxy process's state on the front's stats page (``UP``, ``DOWN`` ...)."""
    rows = httpx.get(f"{stats_url};csv", timeout=5).text.splitlines()
    header = rows[0].lstrip("# ").split(",")
    states = {}
    for row in rows[1:]:
        fields = dict(zip(header, row.split(","), strict=False))
        if fields.get("pxname") == proxy_front.BACKEND and fields.get("svname") not in ("BACKEND", "FRONTEND"):
            states[fields["svname"]] = fields["status"]
    return states


# ---- the configuration, and the rule on stand-in backends ----------------------------------------------


def test_the_configuration_keys_on_the_path_session_then_the_key_headers_then_the_key_parameter() -> None:
    text = proxy_front.haproxy_config(_front_config(proxy_front.default_backends("127.0.0.1", 18100, 2), 18080,
                                                    18099))
    rules = [line.strip() for line in text.splitlines() if "set-var(txn.rw_affinity)" in line]
    sources = [rule.split("set-var(txn.rw_affinity) ", 1)[1].split(" if ", 1)[0] for rule in rules]
    assert sources == ["path,field(3,/)", 'req.fhdr(authorization),regsub("^[Bb]earer +","")',
                       "req.fhdr(x-api-key)", "req.fhdr(x-goog-api-key)", "url_param(key)"]
    assert "path_reg ^/s/[^/]+" in rules[0]
    assert all("!{ var(txn.rw_affinity) -m found }" in rule for rule in rules[1:])  # the first found wins
    lines = {line.strip() for line in text.splitlines()}
    assert {"balance leastconn", "stick on var(txn.rw_affinity)", "retry-on conn-failure",
            "option redispatch 1", "option httpchk GET /health", "option http-no-delay", "bind 127.0.0.1:18080",
            "server proxy-0 127.0.0.1:18100", "server proxy-1 127.0.0.1:18101"} <= lines
    assert not any(line.startswith(("option http-buffer-request", "compression")) for line in lines)
    # Never a retry of a request a process received: no retry-on beyond connection failures.
    assert [line for line in lines if line.startswith("retry-on")] == ["retry-on conn-failure"]


def test_the_server_timeout_outlasts_the_proxys_own() -> None:
    settings = ProxySettings(engine_timeout_s=600, policy_floor_wait_s=600, weight_update_timeout_s=1800)
    assert proxy_front.server_timeout_s(settings) > 1800
    settings = ProxySettings(engine_timeout_s=3000, policy_floor_wait_s=0, weight_update_timeout_s=10)
    assert proxy_front.server_timeout_s(settings) > 3000


def test_backends_parse_and_refuse_what_is_malformed() -> None:
    parsed = proxy_front.parse_backends("proxy-0=http://127.0.0.1:18100, proxy-1=http://10.0.0.2:9")
    assert parsed == (Backend("proxy-0", "127.0.0.1", 18100), Backend("proxy-1", "10.0.0.2", 9))
    assert proxy_front.backends_spec(parsed) == "proxy-0=http://127.0.0.1:18100,proxy-1=http://10.0.0.2:9"
    for bad in ("proxy-0=127.0.0.1:1", "=http://a:1", "a=https://a:1", "a=http://a"):
        with pytest.raises(proxy_front.FrontError):
            proxy_front.parse_backends(bad)
    with pytest.raises(proxy_front.FrontError, match="twice"):
        _front_config(proxy_front.parse_backends("a=http://x:1,a=http://x:2"), 1, 2)


@contextlib.contextmanager
def _haproxy(front: FrontConfig, folder: Path) -> Iterator[str]:
    """The real HAProxy running ``front``'s configuration in the foreground; yields its URL."""
    assert HAPROXY is not None, "haproxy is not installed: apt-get install -y haproxy"
    config = folder / "haproxy.cfg"
    config.write_text(proxy_front.haproxy_config(front))
    check = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    log = folder / "haproxy.log"
    with log.open("wb") as out:
        process = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        stats = f"http://127.0.0.1:{front.stats_port}"
        _wait(lambda: _answers(f"{stats}/health") and set(_server_states(f"{stats}/stats").values()) == {"UP"}, 15,
              f"the front and its backends up: {log.read_text()[-2000:]}")
        yield f"http://127.0.0.1:{front.port}"
    finally:
        process.terminate()
        process.wait(10)


def _named(name: str):  # noqa: ANN202 - a minimal ASGI app
    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": name.encode()})
    return app


def test_the_front_keys_on_the_path_session_then_each_key_in_turn(tmp_path: Path) -> None:
    """On two backends that answer with their name: a value the front sends to one backend, given beside
    one it sends to the other, wins exactly when its source comes first in the rule's order."""
    with serve(_named("a")) as a, serve(_named("b")) as b:
        backends = (Backend("proxy-0", "127.0.0.1", int(a.rsplit(":", 1)[1])),
                    Backend("proxy-1", "127.0.0.1", int(b.rsplit(":", 1)[1])))
        with _haproxy(_front_config(backends, free_port(), free_port()), tmp_path) as url, \
                httpx.Client(base_url=url, timeout=10) as client:
            def served(path: str = "/v1/chat/completions", **headers: str) -> str:
                response = client.post(path, headers=headers)
                assert response.status_code == 200
                assert response.headers[proxy_front.SERVED_BY_HEADER] == {"a": "proxy-0", "b": "proxy-1"}[response.text]
                return response.text

            by_key = {f"k{i}": served(**{"x-api-key": f"k{i}"}) for i in range(16)}
            one = [k for k, side in by_key.items() if side == "a"]
            other = [k for k, side in by_key.items() if side == "b"]
            assert one and other, by_key  # fixed names: the same split every run
            x, y = one[0], other[0]
            for key, side in by_key.items():  # the same value by every source: the same backend
                assert served(authorization=f"Bearer {key}") == side
                assert served(**{"x-goog-api-key": key}) == side
                assert served(f"/v1beta/models/m:generateContent?key={key}") == side
                assert served(f"/s/{key}/v1/chat/completions") == side
                for _ in range(2):
                    assert served(**{"x-api-key": key}) == side  # and again: affinity
            # Each source beats every later one, whichever backend the later one is kept on.
            for first, second in ((x, y), (y, x)):
                expect = by_key[first]
                assert served(f"/s/{first}/v1/chat/completions", authorization=f"Bearer {second}") == expect
                assert served(f"/s/{first}/v1/messages?key={second}", **{"x-api-key": second}) == expect
                assert served(authorization=f"Bearer {first}", **{"x-api-key": second}) == expect
                assert served(**{"x-api-key": first, "x-goog-api-key": second}) == expect
                assert served(f"/v1beta/models/m:generateContent?key={second}", **{"x-goog-api-key": first}) == expect


def _named_slow(name: str, delay_s: float):  # noqa: ANN202 - a minimal ASGI app
    inner = _named(name)

    async def app(scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] == "http":
            await asyncio.sleep(delay_s)
        await inner(scope, receive, send)
    return app


async def test_the_front_spreads_sessions_by_load_and_keeps_each_where_it_began(tmp_path: Path) -> None:
    """Sixteen sessions' first calls at once over two processes (each call takes a while): eight each, by
    the calls in flight, not by the luck of a hash of sixteen names. Each session's later calls, and a call
    by its key instead of its path, go where its first call went."""
    names = [f"fix-add-r1207-s{s}" for s in range(16)]
    with serve(_named_slow("a", 0.4)) as a, serve(_named_slow("b", 0.4)) as b:
        backends = (Backend("proxy-0", "127.0.0.1", int(a.rsplit(":", 1)[1])),
                    Backend("proxy-1", "127.0.0.1", int(b.rsplit(":", 1)[1])))
        with _haproxy(_front_config(backends, free_port(), free_port()), tmp_path) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                async def call(name: str, by_key: bool = False) -> str:
                    if by_key:
                        response = await client.post("/v1/chat/completions", headers={"x-api-key": name})
                    else:
                        response = await client.post(f"/s/{name}/v1/chat/completions")
                    assert response.status_code == 200
                    return response.text

                first = await asyncio.gather(*(call(name) for name in names))
                assert sorted(first.count(side) for side in "ab") == [8, 8], first
                for _ in range(2):
                    assert await asyncio.gather(*(call(name) for name in names)) == first
                assert [await call(name, by_key=True) for name in names[:4]] == first[:4]


# ---- the tier: real proxy processes ---------------------------------------------------------------------


@pytest.fixture
def standin_url() -> Iterator[str]:
    """A stand-in engine whose replies take a few hundred milliseconds, token by token."""
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=TOKENS, token_interval_ms=TOKEN_MS))) as url:
        yield url


@pytest.fixture
def tier_kafka(kafka_bootstrap: str) -> Iterator[KafkaSettings]:
    settings = KafkaSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
                             session_partitions=4, task_partitions=2)
    asyncio.run(ensure_topics(settings))
    yield settings
    asyncio.run(delete_topics(kafka_bootstrap, settings.topic_prefix))


@pytest.fixture
def tier(tier_kafka: KafkaSettings, standin_url: str, tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[stack.ProxyTier]:
    """Two ``rollwire proxy`` processes and the front, brought up by the routine behind ``up --proxies 2``."""
    with proxy_tier(tier_kafka, standin_url, tmp_path / "home", monkeypatch, timeout_s=90) as tier:
        yield tier


def _calls_served(process_url: str) -> int:
    """The model calls a proxy process counted (``rollwire_proxy_requests_total``, every api and status)."""
    text = httpx.get(f"{process_url}/metrics", timeout=5).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("rollwire_proxy_requests_total{")))


def _new_session(url: str, session_id: str) -> dict:
    token = admin_token()
    assert token is not None  # the tier's processes share the deployment's admin token
    response = httpx.post(f"{url}/v1/sessions", json={"session_id": session_id, "api_key": f"key-{session_id}"},
                          headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()


def _call(url: str, session: dict, by: str, *, stream: bool = False) -> httpx.Response:
    """One chat call of ``session`` through the front, addressed ``by`` its path or its key alone."""
    base = f"{url}/s/{session['session_id']}/v1" if by == "path" else f"{url}/v1"
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": stream}
    response = httpx.post(f"{base}/chat/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {session['api_key']}"})
    assert response.status_code == 200, response.text
    return response


def _served_by(tier: stack.ProxyTier, calls: int, session: dict, by: str, dead: str | None = None) -> str:
    """Make ``calls`` calls of ``session``; the one process that served them all (by its own count; the
    ``dead`` one is not asked)."""
    alive = [p for p in tier.processes if p.name != dead]
    before = {p.name: _calls_served(p.address) for p in alive}
    named = {_call(tier.entry.address, session, by).headers[proxy_front.SERVED_BY_HEADER] for _ in range(calls)}
    grew = {p.name: _calls_served(p.address) - before[p.name] for p in alive}
    served = [name for name, count in grew.items() if count]
    assert len(served) == 1 and grew[served[0]] == calls, (session["session_id"], grew)
    assert named == {served[0]}, (named, grew)
    return served[0]


SESSIONS = [(f"tier-{by}-{i}", by) for by in ("path", "key") for i in range(3)]


@pytest.mark.kafka
def test_a_sessions_calls_all_reach_one_process_by_path_and_by_key(tier: stack.ProxyTier) -> None:
    assert tier.front is not None and tier.front.started and len(tier.processes) == 2
    assert tier.entry.address == f"http://127.0.0.1:{os.environ['ROLLWIRE_PROXY_PORT']}"  # the usual address
    sessions = {sid: _new_session(tier.entry.address, sid) for sid, _ in SESSIONS}
    placed = {sid: _served_by(tier, 3, sessions[sid], by) for sid, by in SESSIONS}
    assert set(placed.values()) == {"proxy-0", "proxy-1"}, placed  # fixed ids: the same split every run
    # Streams pass through token by token: the first content arrives well before the last.
    sid, by = SESSIONS[0]
    arrivals: list[float] = []
    base = f"{tier.entry.address}/s/{sid}/v1"
    with httpx.stream("POST", f"{base}/chat/completions", timeout=60,
                      json={"model": "m", "messages": [{"role": "user", "content": "again"}], "stream": True},
                      headers={"authorization": f"Bearer {sessions[sid]['api_key']}"}) as response:
        assert response.status_code == 200
        assert response.headers[proxy_front.SERVED_BY_HEADER] == placed[sid]
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.monotonic())
    assert len(arrivals) >= TOKENS // 2
    assert arrivals[-1] - arrivals[0] >= 0.5 * (TOKENS - 1) * TOKEN_MS / 1000, arrivals
    # Each process has its own name in the tier.
    for process in tier.processes:
        assert (Path(os.environ["ROLLWIRE_HOME"]) / process.name / f"{process.name}.pid").is_file()
    stats = stack.read_tier_record()
    assert stats is not None and [name for name, _ in stats.processes] == ["proxy-0", "proxy-1"]


@pytest.mark.kafka
def test_a_killed_process_s_sessions_are_served_by_the_other(tier: stack.ProxyTier) -> None:
    """kill -9 one process: its sessions' next calls, by path and by key, go to the other process at once and
    are answered (every process reads every session from Kafka); the front takes the dead one out."""
    url = tier.entry.address
    sessions = {sid: _new_session(url, sid) for sid, _ in SESSIONS}
    placed = {sid: _served_by(tier, 1, sessions[sid], by) for sid, by in SESSIONS}
    victim = placed[SESSIONS[0][0]]
    survivor = next(p.name for p in tier.processes if p.name != victim)
    orphans = [(sid, by) for sid, by in SESSIONS if placed[sid] == victim]
    assert {by for _, by in orphans} == {"path", "key"}, placed  # fixed ids: both kinds lost their process
    _, members = stack.tier_services()
    pid = next(m for m in members if m.name == victim).pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for sid, by in orphans:  # no wait for the health check: a refused connection is tried elsewhere
        assert _served_by(tier, 2, sessions[sid], by, dead=victim) == survivor
    for sid, by in SESSIONS:
        if placed[sid] == survivor:
            assert _served_by(tier, 1, sessions[sid], by, dead=victim) == survivor
    assert tier.stats_url is not None
    _wait(lambda: _server_states(tier.stats_url or "") == {victim: "DOWN", survivor: "UP"}, 5,
          "the front marks the killed process down")
    assert _answers(tier.stats_url.replace(proxy_front.STATS_PATH, proxy_front.HEALTH_PATH))


@pytest.mark.kafka
def test_up_with_two_proxies_is_known_to_status_and_down(kafka_bootstrap: str, standin_url: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollwire up --proxies 2` over an engine of its own: status reports each process and the front, a second
    `up` reuses them, a tier of another size is refused with what to do, and `down` stops every one."""
    port, stats_port, first = free_port(), free_port(), stack.free_port_run(2)
    prefix = f"t{uuid.uuid4().hex[:10]}."
    for name, value in (("ROLLWIRE_HOME", str(tmp_path)), ("ROLLWIRE_KAFKA_BOOTSTRAP", kafka_bootstrap),
                        ("ROLLWIRE_TOPIC_PREFIX", prefix), ("ROLLWIRE_ENGINE_URL", standin_url),
                        ("ROLLWIRE_PROXY_PORT", str(port)), ("ROLLWIRE_PROXY_TIER_PORT", str(first)),
                        ("ROLLWIRE_PROXY_STATS_PORT", str(stats_port))):
        monkeypatch.setenv(name, value)
    for name in ("ROLLWIRE_ENGINE_URLS", "ROLLWIRE_PROXY_ADMIN_TOKEN", "ROLLWIRE_PROXY_PUBLIC_URL",
                 "ROLLWIRE_PROXY_COUNT"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()
    try:
        up = runner.invoke(app, ["up", "--proxies", "2", "--no-processors", "--no-ui"])
        assert up.exit_code == 0, up.output
        report = json.loads(runner.invoke(app, ["status", "--json"]).output)
        assert report["proxies"] == 2 and report["proxy_url"] == f"http://127.0.0.1:{port}"
        assert [report[f"proxy{i}_name"] for i in (0, 1)] == ["proxy-0", "proxy-1"]
        assert all(report[f"proxy{i}_healthy"] and report[f"proxy{i}_running"] for i in (0, 1))
        assert report["proxy_front_running"] and report["proxy_front_healthy"]
        assert report["proxy_front_stats_url"] == f"http://127.0.0.1:{stats_port}/stats"
        record = stack.read_tier_record()
        assert record is not None and record.processes == (
            ("proxy-0", f"http://127.0.0.1:{first}"), ("proxy-1", f"http://127.0.0.1:{first + 1}"))
        assert _server_states(record.stats_url) == {"proxy-0": "UP", "proxy-1": "UP"}
        # The processes' own ports answer, and the front on the proxy's usual one.
        assert all(_answers(f"{url}/health") for _, url in record.processes) and _answers(f"{record.url}/health")
        again = runner.invoke(app, ["up", "--proxies", "2", "--no-processors", "--no-ui"])
        assert again.exit_code == 0, again.output
        pids = {m.name: m.pid() for m in stack.tier_services()[1]}
        assert None not in pids.values() and pids == {m.name: m.pid() for m in stack.tier_services()[1]}
        other = runner.invoke(app, ["up", "--proxies", "3", "--no-processors", "--no-ui"])
        assert other.exit_code == 1 and "runs 2 processes, not 3" in other.output, other.output
        down = runner.invoke(app, ["down"])
        assert down.exit_code == 0, down.output
        assert all(f"{name}=stopped" in down.output for name in ("proxy-front", "proxy-0", "proxy-1"))
        assert not any(_answers(f"{url}/health") for _, url in record.processes)
        assert not _answers(f"http://127.0.0.1:{stats_port}/health") and stack.read_tier_record() is None
    finally:
        runner.invoke(app, ["down"])
        asyncio.run(delete_topics(kafka_bootstrap, prefix))
