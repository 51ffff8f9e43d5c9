"""`rollwire session new|end` against a running proxy: a session registered by hand records calls until it
is ended, after which its key is refused."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from deploy.cli import app
from tests.proxy.conftest import ProxyUnderTest

pytestmark = pytest.mark.kafka

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_session_new_then_end_closes_the_key(proxy: ProxyUnderTest) -> None:
    runner = CliRunner()
    created = runner.invoke(app, ["session", "new", "--proxy-url", proxy.url])
    assert created.exit_code == 0, created.output
    session = json.loads(created.output)
    headers = {"authorization": f"Bearer {session['api_key']}"}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers=headers, timeout=30).status_code == 200

    ended = runner.invoke(app, ["session", "end", session["session_id"], "--proxy-url", proxy.url])
    assert ended.exit_code == 0, ended.output
    assert json.loads(ended.output) == {"session_id": session["session_id"], "live": False, "calls": 1,
                                        "origin": "adhoc"}
    refused = httpx.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers=headers, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_ending_an_unknown_session_fails(proxy: ProxyUnderTest) -> None:
    result = CliRunner().invoke(app, ["session", "end", "no-such-session", "--proxy-url", proxy.url])
    assert result.exit_code == 1 and "404" in result.output
