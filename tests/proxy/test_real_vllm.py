"""The proxy against the real vLLM CPU server over the tiny model: what vLLM returned is what is recorded."""

from __future__ import annotations

import json

import httpx
import pytest

from proxy.app import create_app
from proxy.engine import engine_body
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": [{"type": "text", "text": "List the files, then fix the test."}]}]
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command",
                                            "parameters": {"type": "object",
                                                           "properties": {"command": {"type": "string"}}}}}]
FORCED_CALL = r'<tool_call>\n\{"name": "shell", "arguments": \{"command": "echo hi"\}\}\n</tool_call>'


@pytest.fixture
def real_proxy(kafka: KafkaSettings, vllm_url: str):
    with serve(create_app(proxy_settings(vllm_url, engine_timeout_s=120), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line[6:] != "[DONE]"]


async def test_recorded_tokens_are_vllms(real_proxy: ProxyUnderTest, vllm_url: str) -> None:
    session = real_proxy.new_session(engine={"seed": 11, "temperature": 1.0, "max_tokens": 16})
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", timeout=120, headers=auth(session),
                          json={"model": "qwen3-coder", "messages": MESSAGES, "logprobs": True})
    assert response.status_code == 200, response.text
    [event] = await real_proxy.completions(1)
    sent = engine_body(event.request, event.served_model, stream=False)
    with httpx.Client(base_url=vllm_url, timeout=120) as engine:
        tokenized = engine.post("/tokenize", json={"model": event.served_model, "messages": sent["messages"],
                                                   "add_generation_prompt": True}).json()
        direct = engine.post("/v1/chat/completions", json=sent).json()  # same seed: same sample
        text = engine.post("/detokenize", json={"model": event.served_model,
                                                "tokens": event.token_ids.tolist()}).json()["prompt"]
    assert event.prompt_token_ids.tolist() == tokenized["tokens"] == direct["prompt_token_ids"]
    assert event.token_ids.tolist() == direct["choices"][0]["token_ids"]
    assert event.logprobs.tolist() == [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]]
    assert event.logprobs.tolist() == [c["logprob"] for c in response.json()["choices"][0]["logprobs"]["content"]]
    assert text == response.json()["choices"][0]["message"]["content"] == event.message.content
    assert len(event.token_ids) == 16 and event.finish_reason == "length"


async def test_stream_reassembles_to_the_event(real_proxy: ProxyUnderTest, vllm_url: str) -> None:
    session = real_proxy.new_session(engine={"seed": 5, "max_tokens": 24})
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", timeout=120, headers=auth(session),
                          json={"model": "m", "messages": MESSAGES, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    chunks = _sse(response.text)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    [event] = await real_proxy.completions(1)
    with httpx.Client(base_url=vllm_url, timeout=120) as engine:
        text = engine.post("/detokenize", json={"model": event.served_model,
                                                "tokens": event.token_ids.tolist()}).json()["prompt"]
    assert streamed == text == event.message.content
    assert len(event.logprobs) == len(event.token_ids) == chunks[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_call_through_real_vllm(real_proxy: ProxyUnderTest, stream: bool) -> None:
    session = real_proxy.new_session(engine={"seed": 1, "extra": {"structured_outputs": {"regex": FORCED_CALL}}})
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", timeout=120, headers=auth(session),
                          json={"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
                                "stream": stream, "max_tokens": 80})
    assert response.status_code == 200, response.text
    if stream:
        chunks = _sse(response.text)
        name = "".join(p["function"].get("name") or "" for c in chunks if c["choices"]
                       for p in c["choices"][0]["delta"].get("tool_calls") or ())
        arguments = "".join(p["function"].get("arguments") or "" for c in chunks if c["choices"]
                            for p in c["choices"][0]["delta"].get("tool_calls") or ())
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    else:
        choice = response.json()["choices"][0]
        [call] = choice["message"]["tool_calls"]
        name, arguments, finish = call["function"]["name"], call["function"]["arguments"], [choice["finish_reason"]]
    assert name == "shell" and json.loads(arguments) == {"command": "echo hi"} and finish == ["tool_calls"]
    [event] = await real_proxy.completions(1)
    assert event.finish_reason == "tool_calls" and event.message.tool_calls[0].name == "shell"
    assert len(event.logprobs) == len(event.token_ids) > 0
