"""OpenAI Chat Completions through the proxy against the stand-in engine, with capture on real Kafka."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.standin_engine import render_prompt, tokenize
from proxy.engine import engine_body
from tests.proxy.conftest import ProxyUnderTest, auth

pytestmark = pytest.mark.kafka

MESSAGES = [
    {"role": "developer", "content": "You are a coding agent."},
    {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
]
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a command",
                                            "parameters": {"type": "object",
                                                           "properties": {"command": {"type": "string"}}}}}]
FORCED_CALL = r'<tool_call>\n\{"name": "shell", "arguments": \{"command": "echo hi"\}\}\n</tool_call>'


def sse_payloads(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def test_unknown_session_is_refused_in_openai_shape(proxy: ProxyUnderTest) -> None:
    body = {"model": "m", "messages": MESSAGES}
    by_path = httpx.post(f"{proxy.url}/s/no-such-session/v1/chat/completions", json=body,
                         headers={"authorization": "Bearer some-key-123"})
    by_key = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer nope-nope"})
    no_key = httpx.post(f"{proxy.url}/v1/chat/completions", json=body)
    for response in (by_path, by_key, no_key):
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["message"]
    assert "no-such-session" in by_path.json()["error"]["message"]


async def test_whole_reply_is_captured_token_for_token(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(session_id="whole-1")
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", timeout=30, headers=auth(session),
                          json={"model": "gpt-harness", "messages": MESSAGES, "max_tokens": 8, "logprobs": True})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["model"] == "gpt-harness"  # the requested name is restored
    assert "prompt_token_ids" not in reply and "token_ids" not in reply["choices"][0]
    [event] = await proxy.completions(1)
    assert event.session_id == "whole-1" and event.sequence == 0 and event.status == "ok"
    assert event.api == "openai.chat" and event.requested_model == "gpt-harness"
    assert event.served_model == "rollwire-tiny"
    # The prompt ids are exactly what the engine tokenized for the request the proxy sent.
    sent = engine_body(event.request, "rollwire-tiny", stream=False)
    assert event.prompt_token_ids.tolist() == tokenize(render_prompt(sent))
    assert event.token_ids.tolist() == list(reply["choices"][0]["message"]["content"].encode())
    assert event.logprobs.tolist() == [c["logprob"] for c in reply["choices"][0]["logprobs"]["content"]]
    assert event.message.content == reply["choices"][0]["message"]["content"]
    assert event.request.messages[0].role == "developer"
    assert event.usage.completion_tokens == len(event.token_ids)


async def test_stream_reassembles_to_the_recorded_tokens(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    with httpx.stream("POST", f"{session['base_urls']['openai']}/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {session['api_key']}"},
                      json={"model": "qwen3-coder", "messages": MESSAGES, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response.read().decode())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"] or finishes == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["model"] == "qwen3-coder" for c in chunks)
    [event] = await proxy.completions(1)
    assert event.message.content == text
    assert bytes(event.token_ids.tolist()).decode() == text
    assert len(event.logprobs) == len(event.token_ids)
    assert event.usage.completion_tokens == chunks[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_call_comes_back_as_tool_calls(proxy: ProxyUnderTest, stream: bool) -> None:
    session = proxy.new_session(engine={"extra": {"structured_outputs": {"regex": FORCED_CALL}}, "seed": 3})
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "stream": stream,
            "max_tokens": 200, "temperature": 0.7}
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", json=body, timeout=30,
                          headers=auth(session))
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(p) for p in sse_payloads(response.text)[:-1]]
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for part in chunk["choices"][0]["delta"].get("tool_calls") or ():
                call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
                call["name"] += part["function"].get("name") or ""
                call["arguments"] += part["function"].get("arguments") or ""
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finish == ["tool_calls"]
        [call] = calls.values()
    else:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [raw] = choice["message"]["tool_calls"]
        call = raw["function"]
    assert call["name"] == "shell" and json.loads(call["arguments"]) == {"command": "echo hi"}
    [event] = await proxy.completions(1)
    assert event.finish_reason == "tool_calls"
    assert [c.name for c in event.message.tool_calls] == ["shell"]
    # The session's fixed parameters won over the harness's, and the event says what was used.
    assert event.request.sampling.seed == 3 and event.request.sampling.temperature == 0.7
    assert event.request.sampling.extra["structured_outputs"]["regex"] == FORCED_CALL


async def test_sdk_retry_is_marked_as_a_retry_of_the_same_turn(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    url = f"{session['base_urls']['openai']}/chat/completions"
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    headers = {"content-type": "application/json", **auth(session)}
    assert httpx.post(url, content=body, headers=headers).status_code == 200
    assert httpx.post(url, content=body, headers={**headers, "x-stainless-retry-count": "1"}).status_code == 200
    next_turn = json.dumps({"model": "m", "messages": MESSAGES + [{"role": "user", "content": "more"}]}).encode()
    assert httpx.post(url, content=next_turn, headers={**headers, "x-stainless-retry-count": "0"}).status_code == 200
    first, retry, other = await proxy.completions(3)
    assert (first.retry_of, retry.retry_of, other.retry_of) == (None, 0, None)
    assert retry.retry_count == 1 and retry.request_digest == first.request_digest
    assert [first.sequence, retry.sequence, other.sequence] == [0, 1, 2]


async def test_ended_session_is_refused(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    ended = httpx.post(f"{proxy.url}/v1/sessions/{session['session_id']}/end", json={"status": "completed"},
                       headers=auth(session))
    assert ended.status_code == 200 and ended.json()["live"] is False
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", json={"messages": MESSAGES},
                          headers=auth(session))
    assert response.status_code == 401 and "has ended" in response.json()["error"]["message"]
