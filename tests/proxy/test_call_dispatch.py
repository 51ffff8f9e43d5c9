"""Model calls are handed straight to their endpoints, past the framework's per-request layers; every other
path still goes through FastAPI (proxy/app.py)."""

from __future__ import annotations

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app import create_app
from proxy.routes.calls import chat_completions, create_message, create_response, direct_endpoint
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "expected"), [
    ("/v1/chat/completions", (chat_completions, None)),
    ("/v1/responses", (create_response, None)),
    ("/v1/messages", (create_message, None)),
    ("/s/task-1-s0/v1/chat/completions", (chat_completions, "task-1-s0")),
    ("/s/a b/v1/messages", (create_message, "a b")),
    ("/v1/messages/count_tokens", None),
    ("/v1/chat/completions/", None),
    ("/v1/models", None),
    ("/v1beta/models/m:generateContent", None),
    ("/s/x/v1beta/models/m:streamGenerateContent", None),
    ("/s//v1/chat/completions", None),
    ("/s/x", None),
    ("/s/x/y/v1/chat/completions", None),
    ("/v1/sessions", None),
])
def test_the_direct_paths_are_the_model_calls_by_key_and_under_a_session(path: str, expected: object) -> None:
    assert direct_endpoint(path) == expected


class _Seen:
    """A middleware that notes the paths that pass through the framework's stack."""

    def __init__(self, app: ASGIApp, paths: list[str]) -> None:
        self.app, self.paths = app, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(f"{scope['method']} {scope['path']}")
        await self.app(scope, receive, send)


async def test_calls_skip_the_framework_and_everything_else_goes_through_it(kafka: KafkaSettings,
                                                                            standin_url: str) -> None:
    through: list[str] = []
    app = create_app(proxy_settings(standin_url), kafka)
    app.add_middleware(_Seen, paths=through)
    with serve(app) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        base = session["base_urls"]["openai"]
        by_path = httpx.post(f"{base}/chat/completions", json={"messages": MESSAGES, "stream": True},
                             headers=auth(session), timeout=30)
        by_key = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}, headers=auth(session),
                            timeout=30)
        messages = httpx.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": MESSAGES},
                              headers={"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"},
                              timeout=30)
        assert (by_path.status_code, by_key.status_code, messages.status_code) == (200, 200, 200), by_path.text
        assert by_path.text.rstrip().endswith("data: [DONE]")
        # Refused on the direct path, in the provider's shape.
        stranger = httpx.post(f"{url}/s/someone-else/v1/chat/completions", json={"messages": MESSAGES},
                              headers=auth(session), timeout=30)
        assert stranger.status_code == 401 and stranger.json()["error"]["code"] == "invalid_api_key"
        # Through the framework: a Gemini call, a trailing slash (its 404 in the provider's shape), health.
        gemini = httpx.post(f"{session['base_urls']['gemini']}/v1beta/models/m:generateContent",
                            json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
                            headers={"x-goog-api-key": session["api_key"]}, timeout=30)
        slash = httpx.post(f"{url}/v1/chat/completions/", json={"messages": MESSAGES}, headers=auth(session),
                           timeout=30)
        health = httpx.get(f"{url}/health", timeout=30)
        assert (gemini.status_code, slash.status_code, health.status_code) == (200, 404, 200), gemini.text
        assert "error" in slash.json()
        events = await proxy.completions(4)
    assert [(e.api, e.status) for e in events].count(("openai.chat", "ok")) == 2
    assert not [p for p in through if "/chat/completions" in p and not p.endswith("/")]
    assert not [p for p in through if p.endswith("/v1/messages")]
    assert "GET /health" in through and "POST /v1/chat/completions/" in through
    assert any(":generateContent" in p for p in through)
