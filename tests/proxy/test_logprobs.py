"""Logprobs for a harness that asks for them (Chat Completions ``logprobs``/``top_logprobs``), through the
official ``openai`` SDK: each sampled token's entry is the engine's own (token string, bytes, the
``top_logprobs`` alternatives it was asked for), streamed and whole, and its values are the ones the call's
event records, also on an exact continuation (sampled by the token endpoints, which give ids only: named
by derender, and the end-of-sequence id by detokenize). A bad ``top_logprobs`` is a 400 naming the
parameter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from proxy.app import create_app
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

TOP = 3


def client_of(session: dict) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session["base_urls"]["openai"], api_key=session["api_key"], max_retries=0,
                              timeout=30)


def _check_entries(entries: list[Any], text: str) -> list[float]:
    """The engine's entries (one per byte-token of the stand-in): the tokens spell the text, their bytes
    are theirs, and ``TOP`` alternatives are listed, the sampled token first; returns the values."""
    assert "".join(entry.token for entry in entries).startswith(text)
    for entry in entries:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == TOP
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert all(top.logprob <= entry.top_logprobs[1].logprob for top in entry.top_logprobs[2:])
    return [entry.logprob for entry in entries]


async def test_chat_logprobs_are_the_engines_streamed_and_whole(proxy: ProxyUnderTest) -> None:
    client = client_of(proxy.new_session())
    messages: list[Any] = [{"role": "user", "content": "Say something."}]
    stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=16, stream=True,
                                                  logprobs=True, top_logprobs=TOP)
    streamed_text = ""
    streamed: list[Any] = []
    async for chunk in stream:
        if chunk.choices:
            streamed_text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content or []
    whole = await client.chat.completions.create(model="m", messages=messages, max_tokens=16, logprobs=True,
                                                 top_logprobs=TOP)
    plain = await client.chat.completions.create(model="m", messages=messages, max_tokens=16)
    assert plain.choices[0].logprobs is None  # not asked for: not sent
    whole_entries = whole.choices[0].logprobs.content if whole.choices[0].logprobs else []
    values = [_check_entries(streamed, streamed_text),
              _check_entries(whole_entries or [], whole.choices[0].message.content or "")]
    first, second, _ = await proxy.completions(3)
    for event, sent in zip((first, second), values, strict=True):
        assert event.request.sampling.extra.get("top_logprobs") == TOP  # asked of the engine, and recorded
        recorded = event.logprobs.tolist()
        assert len(sent) == len(recorded) == len(event.token_ids) > 0
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(sent, recorded, strict=True))


@pytest.fixture
def exact_proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    engine = create_standin(StandinConfig(latency_ms=1, reply_tokens=12, token_api=True))
    with serve(engine) as engine_url, serve(create_app(proxy_settings(engine_url), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


async def test_an_exact_continuations_logprobs_are_named_by_the_engine(exact_proxy: ProxyUnderTest) -> None:
    answer = {"structured_outputs": {"regex": "All good"}}  # a reply that ends with its end-of-sequence id
    client = client_of(exact_proxy.new_session(engine={"turns": [{}, answer]}))
    messages: list[Any] = [{"role": "user", "content": "Say something."}]
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=12)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    second = await client.chat.completions.create(model="m", messages=messages, max_tokens=40, logprobs=True,
                                                  top_logprobs=TOP)
    _, event = await exact_proxy.completions(2)
    assert event.continuation is not None and event.continuation.mode == "exact"
    assert event.finish_reason == "stop"  # ended by its end-of-sequence id, which derender is not given
    entries = second.choices[0].logprobs.content if second.choices[0].logprobs else None
    assert entries is not None
    recorded = event.logprobs.tolist()
    assert len(entries) == len(recorded) == len(event.token_ids)
    assert all(math.isclose(e.logprob, r, rel_tol=1e-6) for e, r in zip(entries, recorded, strict=True))
    # Named by derender (the text's tokens) and, for the end-of-sequence id, by the engine's detokenize.
    *text, end = entries
    assert "".join(entry.token for entry in text) == second.choices[0].message.content
    assert end.token == "<|im_end|>" and end.bytes == list(b"<|im_end|>")
    assert [len(entry.top_logprobs) for entry in entries] == [TOP] * len(entries)
    assert all(entry.top_logprobs[0].token == entry.token for entry in entries)
    # Streamed, an exact continuation's reply is synthesized from the whole turn: the same entries.
    messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
    stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=12, stream=True,
                                                  logprobs=True)
    text, streamed = "", []
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            streamed += chunk.choices[0].logprobs.content or [] if chunk.choices[0].logprobs else []
    _, _, third = await exact_proxy.completions(3)
    assert third.continuation is not None and third.continuation.mode == "exact"
    assert len(streamed) == len(third.token_ids) and "".join(e.token for e in streamed).startswith(text)
    assert all(entry.top_logprobs == [] for entry in streamed)  # none asked for this time


@pytest.mark.parametrize("asked, message", [
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
])
async def test_a_bad_top_logprobs_is_refused_in_openais_shape(proxy: ProxyUnderTest, asked: dict[str, Any],
                                                              message: str) -> None:
    client = client_of(proxy.new_session())
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, **asked)
    assert caught.value.status_code == 400 and message in caught.value.message
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == "top_logprobs"


# -- the Responses API (include: message.output_text.logprobs) and Gemini (responseLogprobs) ---------------


def _same_values(sent: list[float], event: Any) -> None:
    recorded = event.logprobs.tolist()
    assert len(sent) == len(recorded) == len(event.token_ids) > 0
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(sent, recorded, strict=True))


async def test_responses_logprobs_are_the_engines_streamed_and_whole(proxy: ProxyUnderTest) -> None:
    client = client_of(proxy.new_session())
    asked: dict[str, Any] = {"include": ["message.output_text.logprobs"], "top_logprobs": TOP}
    whole = await client.responses.create(model="m", input="Say something.", max_output_tokens=16, **asked)
    text_part = whole.output[-1].content[0]  # type: ignore[union-attr]
    whole_values = _check_entries(text_part.logprobs or [], whole.output_text)
    streamed_values: list[float] = []
    delta_text, done_entries = "", None
    async with client.responses.stream(model="m", input="Say something.", max_output_tokens=16, **asked) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                delta_text += event.delta
                for entry in event.logprobs:  # the stream's form: token, logprob, alternatives (no bytes)
                    assert len(entry.top_logprobs) == TOP and entry.top_logprobs[0].token == entry.token
                    streamed_values.append(entry.logprob)
            if event.type == "response.output_text.done":
                done_entries = event.logprobs
            if event.type in ("response.completed", "response.incomplete"):  # 16 tokens may cut it short
                final = event.response
    part = final.output[-1].content[0]  # type: ignore[union-attr]
    assert _check_entries(part.logprobs or [], delta_text) == streamed_values
    assert done_entries is not None and [entry.logprob for entry in done_entries] == streamed_values
    plain = await client.responses.create(model="m", input="Say something.", max_output_tokens=16)
    assert plain.output[-1].content[0].logprobs == []  # type: ignore[union-attr]  # not asked for
    first, second, third = await proxy.completions(3)
    for event, sent in ((first, whole_values), (second, streamed_values)):
        assert event.request.sampling.extra.get("top_logprobs") == TOP
        _same_values(sent, event)
    assert "top_logprobs" not in third.request.sampling.extra


async def test_gemini_logprobs_result_is_the_engines_streamed_and_whole(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    url = f"{session['base_urls']['gemini']}/v1beta/models/m"
    headers = {"x-goog-api-key": session["api_key"]}
    body = {"contents": [{"role": "user", "parts": [{"text": "Say something."}]}],
            "generationConfig": {"maxOutputTokens": 16, "responseLogprobs": True, "logprobs": TOP}}
    async with httpx.AsyncClient(timeout=30) as http:
        whole = (await http.post(f"{url}:generateContent", json=body, headers=headers)).json()
        chunks = []
        async with http.stream("POST", f"{url}:streamGenerateContent?alt=sse", json=body, headers=headers) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
        refused = await http.post(f"{url}:generateContent", headers=headers, json={
            **body, "generationConfig": {"logprobs": 2}})
    first, second, *_ = await proxy.completions(2)

    def values_of(candidates: list[dict[str, Any]], event: Any) -> list[float]:
        chosen = [c for candidate in candidates for c in candidate["logprobsResult"]["chosenCandidates"]]
        tops = [t for candidate in candidates for t in candidate["logprobsResult"]["topCandidates"]]
        assert [c["tokenId"] for c in chosen] == event.token_ids.tolist()
        for one, top in zip(chosen, tops, strict=True):
            assert len(top["candidates"]) == TOP and top["candidates"][0]["token"] == one["token"]
        return [c["logProbability"] for c in chosen]

    candidate = whole["candidates"][0]
    text = "".join(part.get("text", "") for part in candidate["content"]["parts"])
    assert "".join(c["token"] for c in candidate["logprobsResult"]["chosenCandidates"]).startswith(text)
    _same_values(values_of([candidate], first), first)
    assert math.isclose(candidate["avgLogprobs"], sum(first.logprobs.tolist()) / len(first.token_ids), rel_tol=1e-6)
    streamed = [chunk["candidates"][0] for chunk in chunks if "logprobsResult" in chunk["candidates"][0]]
    assert len(streamed) > 1  # each chunk its own tokens
    _same_values(values_of(streamed, second), second)
    assert "avgLogprobs" in chunks[-1]["candidates"][0]
    assert refused.status_code == 400
    assert "responseLogprobs" in refused.json()["error"]["message"]
