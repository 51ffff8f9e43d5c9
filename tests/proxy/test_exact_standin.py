"""Exact-token continuation through the stand-in's token endpoints (vLLM's shapes): all four provider APIs,
streamed and whole, the fallback for an engine without the endpoints, and a session in rendered mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka


@pytest.fixture
def exact_proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    engine = create_standin(StandinConfig(latency_ms=1, reply_tokens=12, token_api=True))
    with serve(engine) as engine_url, serve(create_app(proxy_settings(engine_url), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


def extends(child: Completion, parent: Completion) -> bool:
    whole = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()
    return child.prompt_token_ids.tolist()[:len(whole)] == whole


def sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def chat_turn(url: str, session: dict, messages: list[dict], stream: bool) -> str:
    response = httpx.post(f"{url}/chat/completions", headers=auth(session), timeout=30,
                          json={"model": "m", "messages": messages, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    assert response.text.rstrip().endswith("data: [DONE]")
    chunks = sse_data(response.text)
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_chat_session_continues_exactly_streamed_and_whole(exact_proxy: ProxyUnderTest) -> None:
    session = exact_proxy.new_session(engine={"max_tokens": 12})
    base = session["base_urls"]["openai"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    for turn, stream in enumerate((False, True, False)):
        text = chat_turn(base, session, messages, stream)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"next {turn}"}]
    first, second, third = await exact_proxy.completions(3)
    assert first.continuation.mode == "rendered" and first.continuation.opened == "first_call"
    for parent, child in ((first, second), (second, third)):
        assert child.continuation.mode == "exact" and child.continuation.parent_sequence == parent.sequence
        assert extends(child, parent)
        assert child.continuation.prefix_tokens == len(parent.prompt_token_ids) + len(parent.token_ids)
        assert child.continuation.drift is not None and child.continuation.drift.rendered_prompt_tokens > 0
    # A new branch is served by the chat endpoint (streamed as sampled); continuations by generate, which
    # reports the weight versions.
    assert first.weight_versions is None
    assert second.weight_versions and second.weight_versions[0]["version"] == "0"  # vLLM's initial "default" is version 0


def _anthropic(session: dict, history: list[dict]) -> tuple[str, list[dict]]:
    response = httpx.post(f"{session['base_urls']['anthropic']}/v1/messages", headers=auth(session), timeout=30,
                          json={"model": "m", "max_tokens": 12, "messages": history})
    assert response.status_code == 200, response.text
    text = response.json()["content"][0]["text"]
    return text, [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def _responses(session: dict, history: list[dict]) -> tuple[str, list[dict]]:
    response = httpx.post(f"{session['base_urls']['openai']}/responses", headers=auth(session), timeout=30,
                          json={"model": "m", "input": history, "store": False})
    assert response.status_code == 200, response.text
    [message] = [item for item in response.json()["output"] if item["type"] == "message"]
    return message["content"][0]["text"], [message]


def _gemini(session: dict, history: list[dict]) -> tuple[str, list[dict]]:
    response = httpx.post(f"{session['base_urls']['gemini']}/v1beta/models/m:generateContent",
                          headers=auth(session), timeout=30, json={"contents": history})
    assert response.status_code == 200, response.text
    content = response.json()["candidates"][0]["content"]
    return "".join(p.get("text", "") for p in content["parts"]), [content]


@pytest.mark.parametrize("api", ["anthropic", "responses", "gemini"])
async def test_every_api_continues_exactly(exact_proxy: ProxyUnderTest, api: str) -> None:
    session = exact_proxy.new_session(engine={"max_tokens": 12})
    ask = {"anthropic": _anthropic, "responses": _responses, "gemini": _gemini}[api]

    def user(text: str) -> dict:
        return {"role": "user", "parts": [{"text": text}]} if api == "gemini" else {"role": "user", "content": text}

    history = [user("hello")]
    for turn in range(2):
        _, reply = ask(session, history)
        history += reply + [user(f"and then {turn}")]
    first, second = await exact_proxy.completions(2)
    assert second.continuation.mode == "exact" and extends(second, first), second.continuation


async def test_engine_without_token_endpoints_falls_back_and_says_so(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(engine={"max_tokens": 12})
    base = session["base_urls"]["openai"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    text = chat_turn(base, session, messages, False)
    chat_turn(base, session, messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}],
              True)
    first, second = await proxy.completions(2)
    assert first.continuation.mode == "rendered" and first.continuation.opened == "first_call"
    assert second.continuation.mode == "rendered" and second.continuation.parent_sequence == 0
    assert second.continuation.opened == "engine_has_no_token_api"
    assert second.status == "ok"


async def test_rendered_session_keeps_the_chat_endpoint(exact_proxy: ProxyUnderTest) -> None:
    session = exact_proxy.new_session(engine={"max_tokens": 12, "continuation": "rendered"})
    base = session["base_urls"]["openai"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    text = chat_turn(base, session, messages, True)
    chat_turn(base, session, messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}],
              False)
    first, second = await exact_proxy.completions(2)
    assert [first.continuation.mode, second.continuation.mode] == ["rendered", "rendered"]
    assert first.continuation.opened == "first_call" and second.continuation.parent_sequence == 0
    assert second.continuation.drift is None and first.weight_versions is None  # the chat path reports none
