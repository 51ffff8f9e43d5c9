"""Google's Gemini CLI (``@google/gemini-cli``, pinned in ``producers.harness_install.HARNESSES``) run
headless (``gemini -p ... --yolo -o json``) against the proxy's Gemini API, in front of the stand-in engine.

What the CLI sends, as recorded from 0.61.0: ``POST {base}/v1beta/models/{model}:streamGenerateContent?alt=sse``
for its turns (the key in ``x-goog-api-key``; ``systemInstruction`` with role ``user``; its tools as
``functionDeclarations`` with ``parametersJsonSchema``; ``generationConfig`` with ``temperature``/``topP``/
``topK`` and ``thinkingConfig.includeThoughts`` plus ``thinkingBudget`` (2.5) or ``thinkingLevel`` (3.x));
model turns echoed with the ``functionCall.id`` the proxy handed out and, on the first call of each model
turn, the placeholder ``thoughtSignature: "skip_thought_signature_validator"`` when it has none of ours;
results as ``functionResponse`` with the same id and ``{"output": ...}``. With no ``-m`` (model ``auto``) a
router side call comes first: ``generateContent`` (not streamed) on a flash-lite model with
``responseMimeType: application/json`` and a ``responseJsonSchema`` in OpenAPI's upper-case types. It sends
``countTokens`` only for requests with media, and no ``GET /v1beta/models``.

The sessions: a text-only one; a scripted multi-turn one in which the CLI runs its own ``write_file`` (two
calls in parallel) and ``run_shell_command`` tools, then answers; a routed one whose router call gets a
JSON answer that picks the model of the main call; one whose engine also streams reasoning, which the
CLI must keep through the ``thoughtSignature`` (it drops thought parts from its history); and one whose
engine breaks off mid-stream, which the CLI must report as the proxy's error. Every successful call is on
the completions topic with token ids, none got a 5xx, and each continued call's prompt extends the last
one token for token (the stand-in serves vLLM's token endpoints, so the proxy continues exactly).

Set ``ROLLWIRE_RECORD_GEMINI_CLI=1`` to rewrite the request-body fixtures in
``tests/fixtures/harnesses/gemini-cli/`` (paths and the date normalized); ``test_recorded_bodies_parse``
checks the normalizer on them, so a CLI upgrade that changes the wire shows.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from producers.harness_install import ensure_harness
from proxy.apis.gemini import GeminiApi
from proxy.apis.base import Route
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.harnesses.common import (
    ReasoningEngine,
    SessionRun,
    ToolStep,
    assert_calls_recorded,
    assert_exact_continuations,
    assert_no_server_errors,
    assert_prefix_chain,
    clean_env,
    forced_turn,
    make_dirs,
    run_on_session,
    serve_proxy,
)
from tests.proxy.conftest import ProxyUnderTest
from tests.servers import serve

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "gemini-cli"
MODEL = "gemini-2.5-flash"
API = "gemini"
SKIP_SIGNATURE = "skip_thought_signature_validator"  # the CLI's placeholder for a call it got no signature for

FILES = {"a.txt": "alpha\n", "b.txt": "beta\n"}
WRITES = [ToolStep("write_file", {"file_path": name, "content": text}) for name, text in FILES.items()]
SHELL = ToolStep("run_shell_command", {"command": "cat a.txt b.txt", "description": "Show both files."})
FINAL_TEXT = "Both files are written."
# Turn 0 writes both files (two calls in one turn), turn 1 runs a shell command, turn 2 answers.
TOOL_TURNS = ["\n".join(step.text() for step in WRITES), SHELL.text(), FINAL_TEXT]
TOOL_SESSION = {"engine": {"max_tokens": 300, "seed": 3, "turns": [forced_turn(t) for t in TOOL_TURNS]}}
# Free text from a random model rarely ends by itself: the session caps it (the CLI takes MAX_TOKENS with text).
TEXT_ONLY = {"engine": {"max_tokens": 24, "seed": 3}}
# The router's answer, in its responseJsonSchema's shape: a low score routes to a flash model. It is turn 0,
# so the main call (no assistant turn yet either) says it too.
ROUTER_ANSWER = {"complexity_reasoning": "A one-line greeting.", "complexity_score": 5}
ROUTED = {"engine": {"max_tokens": 200, "seed": 3, "turns": [forced_turn(json.dumps(ROUTER_ANSWER))]}}


@pytest.fixture(scope="module")
def standin_url() -> Iterator[str]:
    """A stand-in engine with vLLM's token endpoints: the proxy continues each session exactly."""
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16, token_api=True))) as url:
        yield url


@pytest.fixture
def proxy(kafka: KafkaSettings, standin_url: str) -> Iterator[ProxyUnderTest]:
    """A proxy of the test's own (its request counters are the test's), keeping request bodies."""
    with serve_proxy(standin_url, kafka, record_request_body=True) as proxy:
        yield proxy


@dataclass
class GeminiRun(SessionRun):
    output: dict[str, Any]  # the CLI's ``-o json`` document: response, stats, or error


def settings() -> dict[str, Any]:
    """~/.gemini/settings.json: API-key auth chosen (no interactive auth dialog), no update check, no
    telemetry or usage statistics, no folder-trust prompt."""
    return {"security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
            "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}


async def run_gemini(proxy: ProxyUnderTest, session: dict[str, Any], root: Path, prompt: str,
                     model: str | None = MODEL, *, check: bool = True) -> GeminiRun:
    """``gemini -p PROMPT --yolo -o json`` on the session with only the proxy reachable, and the session's
    events (``model`` None: the CLI's own ``auto`` routing; ``check``: it must exit 0)."""
    gemini = ensure_harness("gemini-cli")
    home, workspace = make_dirs(root)
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps(settings()))
    env = clean_env("GEMINI_", "GOOGLE_")
    # The SDK posts to {base}/v1beta/models/...: the session's Gemini base URL is the bare session root.
    env.update(HOME=str(home), GEMINI_API_KEY=session["api_key"], GOOGLE_GEMINI_BASE_URL=session["base_urls"]["gemini"])
    command = [str(gemini), "-p", prompt, "--yolo", "-o", "json", *(["-m", model] if model else [])]
    run = await run_on_session(proxy, session, command, home=home, workspace=workspace, env=env, timeout_s=300,
                               run_type=GeminiRun, output={})
    if check:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run.output = json_output(run)
    return run


def json_output(run: GeminiRun) -> dict[str, Any]:
    """The CLI's ``-o json`` document: on stdout, or, when the run failed, at the end of stderr."""
    if run.stdout.strip():
        return dict(json.loads(run.stdout))
    start = run.stderr.rfind("\n{\n")
    assert start >= 0, run.stderr[-3000:]
    return dict(json.loads(run.stderr[start:]))


def body(event: Completion) -> dict[str, Any]:
    assert event.request_body is not None
    return json.loads(event.request_body)


def assert_session(proxy: ProxyUnderTest, run: GeminiRun, calls: int) -> None:
    """Every call recorded once with token ids and answered 200, no retry; continued calls extend the last."""
    assert_calls_recorded(run, API, calls, min_prompt_tokens=1000)
    assert_exact_continuations(run.events)
    assert_no_server_errors(proxy, API, calls)


@pytest.mark.kafka
async def test_gemini_cli_text_session(proxy: ProxyUnderTest, tmp_path: Path) -> None:
    session = proxy.new_session(**TEXT_ONLY)
    run = await run_gemini(proxy, session, tmp_path, "say hello")
    assert_session(proxy, run, 1)
    [event] = run.events
    assert event.requested_model == MODEL and event.request.stream
    # Mostly cut by the session's limit (the random words can end first): the CLI takes a MAX_TOKENS reply
    # that has text and prints it.
    assert event.finish_reason in ("length", "stop") and event.message.content
    assert run.output["response"].strip() == event.message.content.strip(), (run.output["response"], event.message)
    assert not event.message.tool_calls
    names = {t.name for t in event.request.tools}
    assert {"write_file", "read_file", "run_shell_command", "replace"} <= names
    assert all(t.parameters and t.parameters["type"] == "object" for t in event.request.tools)
    system, user = event.request.messages
    assert system.role == "system" and "CLI agent" in (system.content or "")
    assert user.role == "user" and "say hello" in json.dumps(user.model_dump(mode="json"))
    sent = body(event)
    assert sent["generationConfig"]["thinkingConfig"]["includeThoughts"] is True


@pytest.mark.kafka
async def test_gemini_cli_tool_session(proxy: ProxyUnderTest, tmp_path: Path) -> None:
    session = proxy.new_session(**TOOL_SESSION)
    run = await run_gemini(proxy, session, tmp_path, "Write alpha to a.txt and beta to b.txt, then show both.")
    for name, text in FILES.items():
        assert (run.workspace / name).read_text() == text, run.stdout[-2000:]
    assert run.output["response"] == FINAL_TEXT
    tools = run.output["stats"]["tools"]
    assert tools["totalCalls"] == 3 and tools["totalSuccess"] == 3, tools
    assert_session(proxy, run, 3)
    first, second, third = run.events
    assert [e.finish_reason for e in run.events] == ["tool_calls", "tool_calls", "stop"]
    assert [(c.name, json.loads(c.arguments)) for c in first.message.tool_calls] == \
        [(s.name, s.arguments) for s in WRITES]
    assert third.message.content == FINAL_TEXT
    # The CLI kept its history: calls 1 and 2 continue the branch of the call before, token for token.
    for parent, child in ((first, second), (second, third)):
        assert child.continuation.mode == "exact" and child.continuation.parent_sequence == parent.sequence
        assert child.continuation.branch == first.continuation.branch and child.continuation.role == "main"
    assert_prefix_chain(run)
    # Both write_file results pair with their calls (by the ids we handed out and the CLI echoed) ...
    assistant, *results = second.request.messages[-3:]
    assert [c.name for c in assistant.tool_calls] == ["write_file", "write_file"]
    assert [r.role for r in results] == ["tool", "tool"] and not any(r.is_error for r in results)
    assert [r.tool_call_id for r in results] == [c.id for c in assistant.tool_calls]
    assert all("Successfully created" in (r.content or "") for r in results)
    # ... and the shell command's output came back to the model.
    shell = third.request.messages[-1]
    assert shell.role == "tool" and "alpha\nbeta" in (shell.content or "")
    # On the wire: the CLI echoes our functionCall ids and puts its placeholder signature on each model turn's
    # first call; the proxy ignores that signature (no reasoning is made up for the turn).
    sent = body(second)
    model_turn, response_turn = sent["contents"][-2:]
    calls = [p["functionCall"] for p in model_turn["parts"]]
    assert model_turn["parts"][0]["thoughtSignature"] == SKIP_SIGNATURE
    assert [p["functionResponse"]["id"] for p in response_turn["parts"]] == [c["id"] for c in calls]
    assert all(c["id"].startswith("gc_") for c in calls) and assistant.reasoning is None
    if os.environ.get("ROLLWIRE_RECORD_GEMINI_CLI") == "1":
        record_fixtures(run, {f"turn{e.sequence}": e for e in run.events})


@pytest.mark.kafka
async def test_gemini_cli_routed_session(proxy: ProxyUnderTest, tmp_path: Path) -> None:
    """No ``-m``: the CLI's router asks a flash-lite model for a JSON complexity score first (a side call
    with a response schema), then sends the prompt to the model that score picks."""
    session = proxy.new_session(**ROUTED)
    run = await run_gemini(proxy, session, tmp_path, "say hello", model=None)
    assert_session(proxy, run, 2)
    router, main = run.events
    assert "flash-lite" in router.requested_model and not router.request.stream and not router.request.tools
    assert router.continuation.role == "side" and main.continuation.role == "main"
    assert json.loads(router.message.content) == ROUTER_ANSWER
    # The schema reaches the engine as JSON Schema (the CLI writes OpenAPI's upper-case type names).
    response_format = router.request.sampling.extra["response_format"]
    schema = response_format["json_schema"]["schema"]
    assert response_format["type"] == "json_schema" and schema["type"] == "object"
    assert {p["type"] for p in schema["properties"].values()} == {"string", "integer"}
    assert body(router)["generationConfig"]["responseJsonSchema"]["type"] == "OBJECT"
    # The low score routed the prompt to a flash model, which got the tools and streamed.
    assert "flash" in main.requested_model and main.requested_model != router.requested_model
    assert main.request.stream and main.request.tools
    assert set(run.output["stats"]["models"]) == {router.requested_model, main.requested_model}
    if os.environ.get("ROLLWIRE_RECORD_GEMINI_CLI") == "1":
        record_fixtures(run, {"router": router})


@pytest.mark.kafka
async def test_gemini_cli_reports_an_engine_failure_mid_stream(proxy: ProxyUnderTest, tmp_path: Path) -> None:
    """The engine breaks off after some text (the stand-in's ``error_object``): the proxy ends the SSE stream
    with Google's bare error object, which the CLI's SDK raises as an API error with its code; the CLI
    retries the stream (its mid-stream limit: 4 attempts) and then fails, printing that error. (With the
    error as a ``data:`` event the SDK saw no error, and the CLI exited 0 with the failed attempts' partial
    text, concatenated, as its answer.)"""
    session = proxy.new_session(engine={"max_tokens": 24, "seed": 3, "extra": {"standin_fail": "error_object"}})
    run = await run_gemini(proxy, session, tmp_path, "say hello", check=False)
    assert run.returncode != 0 and "response" not in run.output, run.stdout[-2000:]
    error = run.output["error"]
    assert error["code"] == 502 and "engine failed mid-stream" in error["message"], error
    assert 2 <= len(run.events) <= 4 and run.session_calls == len(run.events)
    for event in run.events:
        assert event.status == "error" and event.error is not None and event.error.http_status == 502
    # The CLI's retries resend the same body (it sends no retry header, so the events do not link them).
    assert len({e.request_body for e in run.events}) == 1


@pytest.mark.kafka
async def test_gemini_cli_keeps_reasoning_through_its_signature(kafka: KafkaSettings, tmp_path: Path) -> None:
    """The engine reasons before the first tool call: the CLI gets the thought as a ``thought`` part (it asks
    ``includeThoughts``) and our ``thoughtSignature`` on the ``functionCall``; it drops the thought from its
    history but echoes the signature, from which the proxy recovers the reasoning, so the next prompt holds
    the very text the engine produced."""
    thought = "The user wants one file; write_file does it in one call. ✓"
    write = ToolStep("write_file", {"file_path": "a.txt", "content": "alpha\n"})
    session_body = {"engine": {"max_tokens": 300, "seed": 3,
                               "turns": [forced_turn(write.text()), forced_turn("Done.")]}}
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16))) as engine_url, \
            serve_proxy(engine_url, kafka, record_request_body=True,
                        engine_transport=ReasoningEngine(thought)) as proxy:
        session = proxy.new_session(**session_body)
        run = await run_gemini(proxy, session, tmp_path, "Write alpha to a.txt.")
        assert_session(proxy, run, 2)
    assert (run.workspace / "a.txt").read_text() == "alpha\n"
    assert run.output["response"] == "Done." and thought not in run.stdout
    first, second = run.events
    assert first.message.reasoning == thought
    model_turn = body(second)["contents"][-2]
    assert not any(p.get("thought") for p in model_turn["parts"])  # the CLI keeps no thought part ...
    signature = model_turn["parts"][0]["thoughtSignature"]
    assert signature != SKIP_SIGNATURE and thought not in signature  # ... but keeps our signature
    [assistant] = [m for m in second.request.messages if m.role == "assistant"]
    assert assistant.reasoning == thought and assistant.tool_calls[0].name == "write_file"
    assert f"<think>{thought}</think>".encode() in bytes(t for t in second.prompt_token_ids.tolist() if t < 256)


# -- recorded bodies -----------------------------------------------------------------------------------

_DATE_LINE = re.compile(r"Today's date is [^\n]*")
_PGID = re.compile(r"Process Group PGID: \d+")


def _normalized(value: Any, pairs: list[tuple[str, str]]) -> Any:
    """``value`` with every string's run-specific paths and the date replaced."""
    if isinstance(value, str):
        for text, placeholder in pairs:
            value = value.replace(text, placeholder)
        value = _PGID.sub("Process Group PGID: 4242", value)
        return _DATE_LINE.sub("Today's date is Monday, January 5, 2026.", value)
    if isinstance(value, list):
        return [_normalized(v, pairs) for v in value]
    if isinstance(value, dict):
        return {k: _normalized(v, pairs) for k, v in value.items()}
    return value


def record_fixtures(run: GeminiRun, events: dict[str, Completion]) -> None:
    """The request bodies of ``events`` as fixtures, the run's paths and the date replaced."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    pairs = [(str(run.workspace), "/workspace"), (str(run.home), "/home/gemini")]
    for name, event in events.items():
        method = "streamGenerateContent?alt=sse" if event.request.stream else "generateContent"
        fixture = {"cli": "gemini-cli", "package": "@google/gemini-cli@0.61.0",
                   "path": f"v1beta/models/{event.requested_model}:{method}",
                   "body": _normalized(body(event), pairs)}
        (FIXTURES / f"{name}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


def test_recorded_bodies_parse() -> None:
    """Gemini CLI 0.61.0's bodies, as recorded: the normalizer reads every field the way the live run did."""
    api = GeminiApi()
    stream = Route(model=MODEL, stream=True, query={"alt": "sse"})
    turns = [api.parse(_fixture(f"turn{n}"), stream).request for n in range(3)]
    first, second, third = turns
    names = [t.name for t in first.tools]
    assert {"write_file", "read_file", "run_shell_command", "replace", "glob"} <= set(names)
    assert all(t.parameters and t.parameters["type"] == "object" for t in first.tools)
    assert [m.role for m in first.messages] == ["system", "user"]
    assert "/workspace" in json.dumps(first.messages[1].model_dump(mode="json"))
    assert [m.role for m in second.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [m.role for m in third.messages][-2:] == ["assistant", "tool"]
    # Each turn re-sends the same system prompt and tools: the earlier turn's messages are a prefix.
    for earlier, later in zip(turns, turns[1:]):
        assert later.messages[:len(earlier.messages)] == earlier.messages and later.tools == earlier.tools
    assistant, *results = second.messages[2:]
    assert [(c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [(s.name, s.arguments) for s in WRITES]
    assert [r.tool_call_id for r in results] == [c.id for c in assistant.tool_calls]
    assert assistant.reasoning is None  # the placeholder signature is not ours: ignored
    config = _fixture("turn0")["generationConfig"]
    assert config["thinkingConfig"] == {"includeThoughts": True, "thinkingBudget": 8192}
    assert first.sampling.temperature == config["temperature"] and first.sampling.top_k == config["topK"]
    router = api.parse(_fixture("router"), Route(model="gemini-3.5-flash-lite", stream=False)).request
    assert not router.tools and router.reasoning_effort == "high"
    schema = router.sampling.extra["response_format"]["json_schema"]["schema"]
    assert schema["type"] == "object" and schema["properties"]["complexity_score"]["type"] == "integer"
