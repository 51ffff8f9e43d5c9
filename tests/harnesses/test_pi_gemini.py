"""Pi (``@mariozechner/pi-coding-agent``) speaking the Gemini API (its ``google-generative-ai`` provider,
Google's ``@google/genai`` SDK underneath) through the proxy: a text-only session, and a multi-turn session
whose scripted first turn makes Pi run its own ``write`` tool, against the stand-in engine and the real
vLLM CPU server. Every call is on the completions topic with token ids, and the second call's prompt
extends the first's.

Set ``ROLLWIRE_RECORD_PI_GEMINI=1`` to rewrite the request-body fixtures in
``tests/fixtures/harnesses/pi-gemini/`` from the multi-turn run (workspace paths normalized);
``test_recorded_bodies_parse`` checks the normalizer on them, so a Pi upgrade that changes the wire shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from producers.harness_install import ensure_harness
from proxy.apis.gemini import GeminiApi
from proxy.apis.base import Route
from schemas.completions import Completion
from tests.harnesses.common import (
    assert_exit_ok,
    clean_env,
    fresh_topics,
    serve_proxy,
    serve_standin_proxy,
    session_events as recorded_events,
)
from tests.harnesses.isolation import run_harness
from tests.proxy.conftest import ProxyUnderTest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "pi-gemini"
MODEL = "gemini-2.5-flash"
WORKSPACE = "/workspace"
FILE_NAME, FILE_TEXT = "hello.txt", "hello from gemini\n"
FINAL_TEXT = "The file is written."
WRITE_CALL = ("<tool_call>\n" + json.dumps({"name": "write", "arguments": {"path": FILE_NAME, "content": FILE_TEXT}})
              + "\n</tool_call>")
# Turn 0 (no assistant message yet) is forced to Pi's write tool, every later turn to a short final text.
SCRIPTED = {"engine": {"max_tokens": 200, "seed": 3, "turns": [
    {"structured_outputs": {"regex": re.escape(WRITE_CALL)}},
    {"structured_outputs": {"regex": re.escape(FINAL_TEXT)}}]}}
# Free text from a random model rarely ends by itself: the session caps it.
TEXT_ONLY = {"engine": {"max_tokens": 24, "seed": 3}}


@pytest.fixture(scope="module")
def standin_proxy(kafka_bootstrap: str) -> Iterator[ProxyUnderTest]:
    kafka = asyncio.run(fresh_topics(kafka_bootstrap, "pigem", session_partitions=2))
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def vllm_proxy(kafka_bootstrap: str, vllm_url: str) -> Iterator[ProxyUnderTest]:
    kafka = asyncio.run(fresh_topics(kafka_bootstrap, "pigem", session_partitions=2))
    with serve_proxy(vllm_url, kafka, engine_timeout_s=300, record_request_body=True) as proxy:
        yield proxy


def run_pi(proxy: ProxyUnderTest, session: dict, home: Path, instruction: str, *, reasoning: bool = False):
    """Pi in print mode with a throwaway HOME whose models.json points its Gemini provider at the session."""
    pi = ensure_harness("pi")
    (home / ".pi" / "agent").mkdir(parents=True, exist_ok=True)
    # @google/genai sends to {baseUrl}/models/{id}:streamGenerateContent?alt=sse once Pi clears its
    # apiVersion, so the base URL carries the version: {session}/v1beta. The key goes in x-goog-api-key.
    (home / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"rollwire": {
        "baseUrl": f"{session['base_urls']['gemini']}/v1beta", "api": "google-generative-ai",
        "apiKey": session["api_key"],
        "models": [{"id": MODEL, "reasoning": reasoning, "contextWindow": 32768, "maxTokens": 4096}]}}}))
    workspace = home / "work"
    workspace.mkdir(exist_ok=True)
    env = clean_env("GEMINI_", "GOOGLE_")
    env.update(HOME=str(home), PI_OFFLINE="1", PI_SKIP_VERSION_CHECK="1", PI_TELEMETRY="0")
    result = run_harness([str(pi), "-p", "--provider", "rollwire", "--model", MODEL, "--no-session", instruction],
                         cwd=workspace, env=env, proxy_url=proxy.url, timeout_s=600)
    assert_exit_ok(result)
    return result, workspace


async def session_events(proxy: ProxyUnderTest, session_id: str) -> list[Completion]:
    events = await recorded_events(proxy, session_id, "gemini", timeout_s=60)
    for event in events:
        assert event.requested_model == MODEL
        assert event.request.stream and event.request_body is not None
    return events


def assert_tool_session(events: list[Completion], result, workspace: Path) -> None:
    assert (workspace / FILE_NAME).read_text() == FILE_TEXT
    assert FINAL_TEXT in result.stdout
    assert len(events) == 2, [e.message for e in events]
    first, second = events
    [call] = first.message.tool_calls
    assert call.name == "write" and json.loads(call.arguments) == {"path": FILE_NAME, "content": FILE_TEXT}
    assert first.finish_reason == "tool_calls" and second.message.content == FINAL_TEXT
    # Pi sent the call back without an id and its result as a functionResponse: they pair up.
    assistant, tool = second.request.messages[-2:]
    assert [c.name for c in assistant.tool_calls] == ["write"] and tool.role == "tool"
    assert tool.tool_call_id == assistant.tool_calls[0].id and not tool.is_error
    # Pi kept its history: the second prompt extends the first token for token.
    assert second.prompt_token_ids.tolist()[:len(first.prompt_token_ids)] == first.prompt_token_ids.tolist()
    assert len(second.prompt_token_ids) > len(first.prompt_token_ids) + len(first.token_ids) // 2


def record_fixtures(events: list[Completion], home: Path) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for event in events:
        body = event.request_body.replace(str(home / "work"), WORKSPACE).replace(str(home), "/home/pi")
        path = FIXTURES / f"turn{event.sequence}.json"
        path.write_text(json.dumps(json.loads(body), indent=1, ensure_ascii=False) + "\n")


@pytest.mark.kafka
async def test_pi_gemini_text_session(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    session = standin_proxy.new_session(**TEXT_ONLY)
    result, _ = run_pi(standin_proxy, session, tmp_path, "say hello")
    [event] = await session_events(standin_proxy, session["session_id"])
    assert event.message.content and event.message.content.strip() in result.stdout
    assert not event.message.tool_calls and event.request.tools  # Pi offers its tools as functionDeclarations


@pytest.mark.kafka
async def test_pi_gemini_tool_session(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    session = standin_proxy.new_session(**SCRIPTED)
    result, workspace = run_pi(standin_proxy, session, tmp_path, f"write '{FILE_TEXT.strip()}' to {FILE_NAME}",
                               reasoning=True)
    events = await session_events(standin_proxy, session["session_id"])
    assert_tool_session(events, result, workspace)
    if os.environ.get("ROLLWIRE_RECORD_PI_GEMINI") == "1":
        record_fixtures(events, tmp_path)


@pytest.mark.kafka
async def test_pi_gemini_tool_session_on_real_vllm(vllm_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    session = vllm_proxy.new_session(**SCRIPTED)
    result, workspace = run_pi(vllm_proxy, session, tmp_path, f"write '{FILE_TEXT.strip()}' to {FILE_NAME}")
    assert_tool_session(await session_events(vllm_proxy, session["session_id"]), result, workspace)


def test_recorded_bodies_parse() -> None:
    """Pi 0.73.1's Gemini bodies, as recorded: the normalizer reads every field the way the live run did."""
    first, second = (json.loads((FIXTURES / f"turn{n}.json").read_text()) for n in (0, 1))
    api = GeminiApi()
    route = Route(model=MODEL, stream=True, query={"alt": "sse"})
    one, two = api.parse(first, route), api.parse(second, route)
    assert one.requested_model == MODEL and one.stream
    names = [t.name for t in one.request.tools]
    assert {"read", "bash", "edit", "write"} <= set(names)
    assert all(t.parameters and t.parameters["type"] == "object" for t in one.request.tools)
    assert [m.role for m in one.request.messages] == ["system", "user"]
    assert WORKSPACE in one.request.messages[0].content
    assert [m.role for m in two.request.messages] == ["system", "user", "assistant", "tool"]
    assistant, tool = two.request.messages[2:]
    [call] = assistant.tool_calls
    assert call.name == "write" and json.loads(call.arguments) == {"path": FILE_NAME, "content": FILE_TEXT}
    assert tool.tool_call_id == call.id and tool.content and not tool.is_error
    # Pi re-sends the same system prompt and tools, so the first turn's messages are a prefix of the second's.
    assert two.request.messages[:2] == one.request.messages and two.request.tools == one.request.tools
    # The second body carries what Pi keeps from our reply: the functionCall, with no id of its own.
    model_turn = second["contents"][1]
    assert model_turn["role"] == "model" and "id" not in model_turn["parts"][-1]["functionCall"]
    assert second["contents"][2]["parts"][0]["functionResponse"]["name"] == "write"
