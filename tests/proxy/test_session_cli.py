"""`rollwire session new|end` against a running proxy: a session registered by hand records calls until it
is ended, after which its key is refused; `session new` sets the session's engine fields (fault 8), checks
its options before calling the proxy (exit 2) and reports an unreachable or refusing proxy (exit 1)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import NoReturn

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from deploy.cli import app
from schemas.sessions import SessionSpec
from schemas.topics import Topic
from schemas.transport import EventConsumer
from tests.proxy.conftest import ProxyUnderTest

pytestmark = pytest.mark.kafka

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_session_new_then_end_closes_the_key(proxy: ProxyUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_UI_URL", "http://ui.example:8799/")
    runner = CliRunner()
    created = runner.invoke(app, ["session", "new", "--proxy-url", proxy.url])
    assert created.exit_code == 0, created.output
    session = json.loads(created.output)
    # The session's page in the web UI (ROLLWIRE_UI_URL).
    assert session["page"] == f"http://ui.example:8799/sessions/{session['session_id']}"
    headers = {"authorization": f"Bearer {session['api_key']}"}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers=headers, timeout=30).status_code == 200

    # Ending it takes its own key: without one (and no admin token here) the proxy refuses, nothing ends.
    refused = runner.invoke(app, ["session", "end", session["session_id"], "--proxy-url", proxy.url])
    assert refused.exit_code == 1 and "401" in refused.output, refused.output
    ended = runner.invoke(app, ["session", "end", session["session_id"], "--proxy-url", proxy.url,
                                "--api-key", session["api_key"]])
    assert ended.exit_code == 0, ended.output
    assert json.loads(ended.output) == {"session_id": session["session_id"], "live": False, "calls": 1,
                                        "origin": "adhoc"}
    refused = httpx.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers=headers, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_ending_an_unknown_session_fails(proxy: ProxyUnderTest) -> None:
    result = CliRunner().invoke(app, ["session", "end", "no-such-session", "--proxy-url", proxy.url])
    assert result.exit_code == 1 and "404" in result.output


async def test_fault8_session_new_sets_engine_fields(proxy: ProxyUnderTest, tmp_path: Path) -> None:
    """Fault 8: `rollwire session new` could only set the session id. Its engine options now reach the
    session spec, and the proxy applies them over what the harness asks for."""
    turns = tmp_path / "turns.json"
    turns.write_text(json.dumps([{"standin_note": "turn0"}, {"standin_note": "later"}]), encoding="utf-8")
    created = CliRunner().invoke(app, [
        "session", "new", "--proxy-url", proxy.url, "--max-tokens", "5", "--seed", "7", "--temperature", "0",
        "--top-p", "0.5", "--top-k", "3", "--extra", '{"repetition_penalty": 1.0}', "--turns", f"@{turns}",
        "--task-id", "task-f8", "--agent", "qwen-code", "--builder", "per_request", "--policy-version", "v3",
        "--timeout-s", "600", "--api-key", "rw-fault8-key", "--metadata", '{"by": "hand"}'])
    assert created.exit_code == 0, created.output
    session = json.loads(created.output)
    assert set(session) == {"session_id", "api_key", "base_urls", "page"} and session["api_key"] == "rw-fault8-key"

    body = {**BODY, "max_tokens": 64, "temperature": 0.9, "seed": 1}
    headers = {"authorization": f"Bearer {session['api_key']}"}
    reply = httpx.post(f"{session['base_urls']['openai']}/chat/completions", json=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text

    [event] = await proxy.completions(1)
    assert event.session_id == session["session_id"] and event.task_id == "task-f8"
    sampling = event.request.sampling
    assert (sampling.max_tokens, sampling.seed, sampling.temperature) == (5, 7, 0.0)
    assert (sampling.top_p, sampling.top_k) == (0.5, 3)
    assert sampling.extra == {"repetition_penalty": 1.0, "standin_note": "turn0"}

    async with EventConsumer(proxy.kafka, [Topic.SESSIONS], group_id=None, dead_letters=False) as consumer:
        specs = [r.event for r in await consumer.getmany(timeout_ms=3000) if isinstance(r.event, SessionSpec)]
    [spec] = [s for s in specs if s.session_id == session["session_id"]]
    assert spec.engine.max_tokens == 5 and spec.engine.seed == 7 and spec.engine.temperature == 0.0
    assert spec.engine.turns == [{"standin_note": "turn0"}, {"standin_note": "later"}]
    assert spec.agent is not None and spec.agent.harness == "qwen-code"
    assert (spec.builder, spec.policy_version, spec.timeout_s, spec.metadata) == ("per_request", "v3", 600.0,
                                                                                  {"by": "hand"})


def _fails_without_calling(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> Result:
    """Run `session new` with ``args`` where any HTTP call fails the test: bad values must not be sent."""
    def no_post(*_: object, **__: object) -> NoReturn:
        raise AssertionError("the proxy must not be called for a bad option value")
    monkeypatch.setattr(httpx, "post", no_post)
    return CliRunner().invoke(app, ["session", "new", "--proxy-url", "http://127.0.0.1:9", *args])


def test_bad_turns_json_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _fails_without_calling(monkeypatch, ["--turns", '[{"a": 1'])
    assert result.exit_code == 2, result.output
    assert "--turns" in result.output and "not valid JSON" in result.output


@pytest.mark.parametrize(("args", "said"), [
    (["--turns", "[1, 2]"], "--turns (0): Input should be a valid dictionary"),
    (["--extra", "[]"], "--extra: Input should be a valid dictionary"),
    (["--max-tokens", "0"], "--max-tokens: Input should be greater than or equal to 1"),
    (["--top-p", "1.5"], "--top-p: Input should be less than or equal to 1"),
    (["--temperature", "-1"], "--temperature: Input should be greater than or equal to 0"),
    (["--builder", "greedy"], "--builder: Input should be 'per_request' or 'prefix_merging'"),
    (["--agent", "vim"], "--agent (harness): Input should be"),
    (["--api-key", "short"], "--api-key: String should have at least 8 characters"),
    (["--session-id", "has space"], "--session-id: String should match pattern"),
    (["--metadata", "@/no/such/file.json"], "--metadata: cannot read"),
])
def test_bad_values_exit_2_without_calling_the_proxy(monkeypatch: pytest.MonkeyPatch, args: list[str],
                                                     said: str) -> None:
    result = _fails_without_calling(monkeypatch, args)
    assert result.exit_code == 2, result.output
    assert said in result.output


def test_unreachable_proxy_exits_1() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = CliRunner().invoke(app, ["session", "new", "--max-tokens", "5", "--proxy-url", url])
    assert result.exit_code == 1, result.output
    assert "cannot reach the proxy" in result.output and url in result.output


def test_proxy_refusal_exits_1_with_its_message(proxy: ProxyUnderTest) -> None:
    first = CliRunner().invoke(app, ["session", "new", "--session-id", "dup-1", "--proxy-url", proxy.url])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["session", "new", "--session-id", "dup-1", "--proxy-url", proxy.url])
    assert again.exit_code == 1
    assert "409" in again.output and "already exists" in again.output


def test_the_cli_sends_the_deployments_admin_token(kafka, standin_url: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A proxy started by `rollwire up` takes the token kept in $ROLLWIRE_HOME: the CLI reads it from there,
    # while a caller without it (a harness reaching the proxy) can neither create nor end a session.
    from proxy.app import create_app
    from schemas.admin_token import ADMIN_TOKEN_VARIABLE, ensure_admin_token
    from tests.proxy.conftest import proxy_settings
    from tests.servers import serve

    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.delenv(ADMIN_TOKEN_VARIABLE, raising=False)
    token = ensure_admin_token()
    with serve(create_app(proxy_settings(standin_url, proxy_admin_token=token), kafka)) as url:
        refused = httpx.post(f"{url}/v1/sessions", json={}, timeout=30)
        assert refused.status_code == 401, refused.text
        runner = CliRunner()
        created = runner.invoke(app, ["session", "new", "--proxy-url", url])
        assert created.exit_code == 0, created.output
        session_id = json.loads(created.output)["session_id"]
        assert httpx.post(f"{url}/v1/sessions/{session_id}/end", json={}, timeout=30).status_code == 401
        ended = runner.invoke(app, ["session", "end", session_id, "--proxy-url", url])  # the token again
        assert ended.exit_code == 0 and json.loads(ended.output)["live"] is False, ended.output
