"""What SDKs ask about models besides calling one (proxy/apis/model_catalog.py): OpenAI's and Anthropic's
``GET /v1/models`` on the path they share, Gemini's model resource and ``countTokens``. Each answers in
its provider's shape, needs the session's key, and leaves no completion event."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.proxy.conftest import ProxyUnderTest, auth

USER = {"role": "user", "parts": [{"text": "List the files."}]}
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def served_model(standin_url: str) -> dict:
    return httpx.get(f"{standin_url}/v1/models", timeout=10).json()["data"][0]


@pytest.mark.kafka
async def test_openai_and_anthropic_listings_share_a_path_and_keep_their_shapes(
        proxy: ProxyUnderTest, standin_url: str) -> None:
    engine_model = served_model(standin_url)["id"]
    session = proxy.new_session()
    base = session["base_urls"]["openai"]
    listed = httpx.get(f"{base}/models", headers=auth(session), timeout=10)
    assert listed.status_code == 200, listed.text
    assert listed.json()["object"] == "list"
    [model] = listed.json()["data"]
    assert (model["id"], model["object"]) == (engine_model, "model") and isinstance(model["created"], int)
    # Any name a harness is configured with is served (by the engine's model), so a lookup finds it.
    named = httpx.get(f"{base}/models/Qwen/Qwen3-8B", headers=auth(session), timeout=10).json()
    assert (named["id"], named["object"]) == ("Qwen/Qwen3-8B", "model")

    anthropic = {"x-api-key": session["api_key"], **ANTHROPIC}
    page = httpx.get(f"{session['base_urls']['anthropic']}/v1/models", headers=anthropic, timeout=10).json()
    assert page["has_more"] is False and page["first_id"] == page["last_id"] == engine_model
    assert [(m["type"], m["id"]) for m in page["data"]] == [("model", engine_model)]
    one = httpx.get(f"{session['base_urls']['anthropic']}/v1/models/claude-sonnet-4-5", headers=anthropic,
                    timeout=10).json()
    assert (one["type"], one["id"], one["display_name"]) == ("model", "claude-sonnet-4-5", "claude-sonnet-4-5")
    assert one["created_at"].endswith("Z")

    # The session's key is needed, and a refusal (or an unknown path) comes in the asker's own shape.
    refused = httpx.get(f"{proxy.url}/v1/models", headers={"authorization": "Bearer nope"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["message"]
    refused = httpx.get(f"{proxy.url}/v1/models", headers={"x-api-key": "nope", **ANTHROPIC}, timeout=10)
    assert refused.status_code == 401 and refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "authentication_error"
    missing = httpx.delete(f"{proxy.url}/v1/models/x", headers={"x-api-key": "k", **ANTHROPIC}, timeout=10)
    assert missing.status_code == 405 and missing.json()["type"] == "error"
    # None of these is a model call: the one call after them is the session's only event.
    called = httpx.post(f"{base}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                        headers=auth(session), timeout=30)
    assert called.status_code == 200, called.text
    [event] = await proxy.completions(1)
    assert event.sequence == 0 and event.status == "ok"
    await asyncio.sleep(0.5)
    assert len(await proxy.completions(1, raw=True)) == 1


@pytest.mark.kafka
async def test_gemini_model_resource_and_count_tokens(proxy: ProxyUnderTest, standin_url: str) -> None:
    engine = served_model(standin_url)
    session = proxy.new_session()
    key = {"x-goog-api-key": session["api_key"]}
    base = f"{session['base_urls']['gemini']}/v1beta/models"
    [listed] = httpx.get(base, headers=key, timeout=10).json()["models"]
    assert listed["name"] == f"models/{engine['id']}"
    one = httpx.get(f"{base}/gemini-2.5-flash", headers=key, timeout=10).json()
    assert one["name"] == "models/gemini-2.5-flash" and "countTokens" in one["supportedGenerationMethods"]
    if engine.get("max_model_len") is not None:
        assert one["inputTokenLimit"] == engine["max_model_len"]

    system = {"parts": [{"text": "You are a coding agent."}]}
    counted = httpx.post(f"{base}/gemini-2.5-flash:countTokens", headers=key, timeout=10,
                         json={"contents": [USER]})
    wrapped = httpx.post(f"{base}/gemini-2.5-flash:countTokens", headers=key, timeout=10,
                         json={"generateContentRequest": {"model": "models/gemini-2.5-flash", "contents": [USER],
                                                          "systemInstruction": system}})
    assert counted.status_code == 200 and wrapped.status_code == 200, (counted.text, wrapped.text)
    called = httpx.post(f"{base}/gemini-2.5-flash:generateContent", headers=key, timeout=30,
                        json={"contents": [USER], "systemInstruction": system,
                              "generationConfig": {"maxOutputTokens": 4}})
    assert called.status_code == 200, called.text
    [event] = await proxy.completions(1)  # the call, and nothing for the counts
    assert wrapped.json() == {"totalTokens": len(event.prompt_token_ids)}
    assert 0 < counted.json()["totalTokens"] < wrapped.json()["totalTokens"]  # without the system prompt

    refused = httpx.get(base, headers={"x-goog-api-key": "nope"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["status"] == "UNAUTHENTICATED"
    posted_as_get = httpx.get(f"{base}/gemini-2.5-flash:generateContent", headers=key, timeout=10)
    assert posted_as_get.status_code == 405 and posted_as_get.json()["error"]["status"] == "UNIMPLEMENTED"
