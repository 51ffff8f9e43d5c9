"""Harness adapters: each of the six real CLIs, configured only by its adapter's invocation (HOME files,
environment, command line, stdin) and run through the local runtime, finishes a text-only session against a
proxy over the stand-in engine, and the proxy records its calls with the task's instruction intact
(quotes, a newline, and a leading dash that a CLI could mistake for an option). The generic ``command``
adapter runs a small Python client whose instruction arrives as one argument. Bad settings and
templates are refused before anything runs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from producers.adapters import ADAPTERS, adapter_for
from producers.adapters.base import AdapterError, HarnessContext
from producers.adapters.command import render_command
from producers.runtimes.local import LocalHandle, LocalRuntime
from schemas.completions import ChatMessage, Completion
from schemas.prompt_chain import resolve_session
from schemas.tasks import RuntimeSpec
from schemas.topics import Topic
from schemas.transport import EventConsumer
from tests.harnesses.common import ToolStep, forced_turn, fresh_topics, literal_regex, serve_standin_proxy
from tests.proxy.conftest import ProxyUnderTest

pytestmark = pytest.mark.kafka

MODEL = "qwen3-coder"
# A markdown bullet (leading dash), quotes, an apostrophe, a newline and a shell variable: all must reach
# the model as written.
INSTRUCTION = '- Say hello to "rollwire".\nIt\'s a test; do not touch $HOME.'
# Every turn answers this text and stops (free text would end on max_tokens, which Codex and Claude Code
# report as an error).
ANSWER = "Hello from rollwire."
CLI_APIS = {"codex": "openai.responses", "claude-code": "anthropic.messages", "qwen-code": "openai.chat",
            "pi": "openai.chat", "gemini-cli": "gemini", "opencode": "openai.chat"}


@pytest.fixture(scope="module")
def proxy(kafka_bootstrap: str) -> Iterator[ProxyUnderTest]:
    kafka = asyncio.run(fresh_topics(kafka_bootstrap, "adapters", session_partitions=2))
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


@pytest.fixture
def runtime(tmp_path: Path) -> LocalRuntime:
    return LocalRuntime(tmp_path / "sessions")


def context(session: dict[str, Any], handle: LocalHandle, *, instruction: str = INSTRUCTION,
            settings: dict[str, Any] | None = None, command: str | None = None) -> HarnessContext:
    return HarnessContext(session_id=session["session_id"], instruction=instruction, model=MODEL,
                          api_key=session["api_key"], base_urls=session["base_urls"], home=handle.home,
                          workspace=handle.workspace, settings=settings or {}, command=command)


async def session_completions(proxy: ProxyUnderTest, session_id: str, timeout_s: float = 30) -> list[Completion]:
    """The session's completion events, in call order, once there are as many as the proxy counted calls."""
    calls = proxy.session_state(session_id)["calls"]
    found: dict[int, Completion] = {}
    async with EventConsumer(proxy.kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        async def collect() -> None:
            while len(found) < calls:
                for record in await consumer.getmany(timeout_ms=300):
                    if record.event.session_id == session_id:
                        found[record.event.sequence] = record.event
        await asyncio.wait_for(collect(), timeout_s)
    return resolve_session([found[k] for k in sorted(found)]).resolved


def text_of(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text or "" for part in message.content or [])


async def run_adapter(proxy: ProxyUnderTest, runtime: LocalRuntime, harness: str, *,
                      settings: dict[str, Any] | None = None, command: str | None = None,
                      instruction: str = INSTRUCTION, answer: str = ANSWER,
                      turns: list[dict[str, Any]] | None = None):
    """One session run by ``harness``'s adapter in a fresh local runtime: (result, events, handle, ctx).
    Every turn answers ``answer``, or the model says what ``turns`` force, turn by turn."""
    turns = turns or [{"structured_outputs": {"regex": literal_regex(answer)}}]
    session = proxy.new_session(engine={"max_tokens": max(512, len(answer)), "seed": 3, "turns": turns})
    handle = await runtime.init(session["session_id"], RuntimeSpec(), timeout_s=60)
    ctx = context(session, handle, instruction=instruction, settings=settings, command=command)
    invocation = adapter_for(harness).invocation(ctx)
    await handle.write_home_files(invocation.home_files)
    result = await handle.run(invocation.argv, env=invocation.env, stdin=invocation.stdin, timeout_s=300)
    events = await session_completions(proxy, session["session_id"])
    return result, events, handle, ctx


@pytest.mark.parametrize("harness", list(CLI_APIS))
async def test_cli_adapter_runs_a_session_through_the_local_runtime(proxy: ProxyUnderTest, runtime: LocalRuntime,
                                                                    harness: str) -> None:
    result, events, handle, _ = await run_adapter(proxy, runtime, harness)
    try:
        assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert len(events) >= 1
        assert [(e.status, e.api) for e in events] == [("ok", CLI_APIS[harness])] * len(events)
        # As written in the agent's own call (opencode asks for a title first, the instruction quoted in it).
        said = [text_of(m) for e in events for m in e.request.messages if m.role == "user"]
        assert any(INSTRUCTION in text for text in said), said
        # Harness config went to the session's HOME, not into the workspace or its patch.
        assert await handle.patch() == ""
    finally:
        await handle.teardown()


@pytest.mark.parametrize("harness", ["gemini-cli", "qwen-code"])
async def test_a_repetitive_reply_is_not_cut_by_the_harness_loop_detector(proxy: ProxyUnderTest,
                                                                         runtime: LocalRuntime, harness: str) -> None:
    # Gemini CLI (and Qwen Code, its fork, when its heuristics are on) aborts a stream in which one 50-char
    # chunk repeats ten times close together, injects a feedback message and asks again: the cut call is
    # recorded as the client's hang-up, unusable for training, and the next turn is the harness's, not the
    # task's. A policy that loops is what RL needs to see; the session's timeout bounds it. Lower case and
    # no punctuation: Gemini's detector resets on a chunk of only [+-_] characters (its "divider" class,
    # which holds capitals and '.'), and the stand-in streams a forced answer a character at a time.
    answer = "i will read the file and then fix the bug " * 16
    result, events, handle, _ = await run_adapter(proxy, runtime, harness, instruction="Fix the bug.", answer=answer)
    try:
        assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
        # One call, answered whole: no hang-up mid-reply, and no "Potential loop detected" message injected
        # as a user turn with a second call (what Gemini CLI does on a first detection).
        assert [e.status for e in events] == ["ok"], [(e.status, e.error) for e in events]
        assert "Loop detected" not in result.stdout + result.stderr
    finally:
        await handle.teardown()


async def test_opencode_runs_a_repeated_tool_call_without_asking(proxy: ProxyUnderTest, runtime: LocalRuntime) -> None:
    # opencode asks for its "doom_loop" permission when one reply repeats a tool call three times; in a
    # rollout no one answers, and `opencode run` rejected it and ended the session with exit 1.
    echo = ToolStep("bash", {"command": "echo again", "description": "Say again."})
    turns = [forced_turn("\n".join([echo.text()] * 3))] * 2 + [forced_turn(ANSWER)]
    result, events, handle, _ = await run_adapter(proxy, runtime, "opencode", instruction="Say again.", turns=turns)
    try:
        assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert [e.status for e in events] == ["ok"] * len(events)
        ran = [json.loads(line)["part"] for line in result.stdout.splitlines() if '"tool_use"' in line]
        assert [(p["tool"], p["state"]["status"]) for p in ran] == [("bash", "completed")] * 6, ran
    finally:
        await handle.teardown()


async def test_pi_adapter_speaks_gemini_when_asked(proxy: ProxyUnderTest, runtime: LocalRuntime) -> None:
    result, events, handle, _ = await run_adapter(proxy, runtime, "pi", settings={"api": "gemini"},
                                                  instruction="Say hello.")
    try:
        assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert len(events) >= 1 and [(e.status, e.api) for e in events] == [("ok", "gemini")] * len(events)
    finally:
        await handle.teardown()


async def test_opencode_adapter_speaks_responses_when_asked(proxy: ProxyUnderTest, runtime: LocalRuntime) -> None:
    result, events, handle, _ = await run_adapter(proxy, runtime, "opencode", settings={"api": "responses"})
    try:
        assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert len(events) >= 2 and [(e.status, e.api) for e in events] == [("ok", "openai.responses")] * len(events)
        # The instruction came on stdin: the agent's call has it exactly as the task wrote it.
        assert INSTRUCTION in [text_of(m) for m in events[-1].request.messages if m.role == "user"]
    finally:
        await handle.teardown()


# A client any harness could be: one chat completion on the session, its argv and answer written down.
CLIENT = """
import json, sys, urllib.request
base_url, api_key, model, instruction = sys.argv[1:5]
request = urllib.request.Request(base_url + "/chat/completions", method="POST",
    headers={"Authorization": "Bearer " + api_key, "Content-Type": "application/json"},
    data=json.dumps({"model": model, "messages": [{"role": "user", "content": instruction}]}).encode())
answer = json.load(urllib.request.urlopen(request, timeout=60))
json.dump({"argv": sys.argv[1:], "answer": answer["choices"][0]["message"]["content"]}, open("client.json", "w"))
"""


async def test_command_adapter_runs_any_command_line(proxy: ProxyUnderTest, runtime: LocalRuntime,
                                                     tmp_path: Path) -> None:
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    template = f"{sys.executable} {client} {{base_url}} {{api_key}} {{model}} {{instruction}} {{session_id}}"
    result, events, handle, ctx = await run_adapter(proxy, runtime, "command", command=template)
    try:
        assert result.exit_code == 0, result.stderr[-3000:]
        written = json.loads((Path(handle.workspace) / "client.json").read_text())
        assert written["argv"] == [ctx.base_urls["openai"], ctx.api_key, MODEL, INSTRUCTION, ctx.session_id]
        [event] = events
        assert event.status == "ok" and event.api == "openai.chat"
        assert text_of(event.request.messages[-1]) == INSTRUCTION
        assert written["answer"] == event.message.content
    finally:
        await handle.teardown()


async def test_command_adapter_env_and_shell_templates(runtime: LocalRuntime) -> None:
    """The session is in the environment too (what a ``sh -c`` script reads), and a quoted placeholder after
    the script is one argument for it."""
    handle = await runtime.init("cmd-env", RuntimeSpec(), timeout_s=60)
    try:
        session_url = "http://127.0.0.1:1/s/cmd-env"
        session = {"session_id": "cmd-env", "api_key": "k-123456789",
                   "base_urls": {"openai": f"{session_url}/v1", "anthropic": session_url, "gemini": session_url}}
        template = ("sh -c 'printf \"%s|\" \"$ROLLWIRE_INSTRUCTION\" \"$1\" \"$OPENAI_BASE_URL\" "
                    "\"$ANTHROPIC_API_KEY\" \"$ROLLWIRE_MODEL\" \"$EXTRA\"' sh \"{instruction}\"")
        ctx = context(session, handle, command=template, settings={"env": {"EXTRA": "x"}})
        invocation = adapter_for("command").invocation(ctx)
        result = await handle.run(invocation.argv, env=invocation.env, timeout_s=30)
        assert result.exit_code == 0, result.stderr
        assert result.stdout == f"{INSTRUCTION}|{INSTRUCTION}|http://127.0.0.1:1/s/cmd-env/v1|k-123456789|{MODEL}|x|"
    finally:
        await handle.teardown()


def test_command_templates_quote_every_value() -> None:
    values = {"instruction": "a 'b' \"c\"\nd", "model": "m", "base_url": "http://h/v1"}
    assert render_command("tool --prompt {instruction} -m {model}", values) == [
        "tool", "--prompt", values["instruction"], "-m", "m"]
    assert render_command('tool --prompt="{instruction}" --url={base_url}', values) == [
        "tool", f"--prompt={values['instruction']}", "--url=http://h/v1"]
    assert render_command("tool '{instruction}' {unknown}", values) == ["tool", values["instruction"], "{unknown}"]
    assert render_command("curl -d '{\"model\": \"{model}\"}' {base_url}", values) == [
        "curl", "-d", '{"model": "m"}', "http://h/v1"]
    with pytest.raises(AdapterError, match="does not parse"):
        render_command("tool 'unbalanced", values)
    with pytest.raises(AdapterError, match="empty"):
        render_command("   ", values)


def fake_context(**overrides: Any) -> HarnessContext:
    values: dict[str, Any] = dict(session_id="s1", instruction="fix it", model=MODEL, api_key="key-123456",
                                  base_urls={"openai": "http://127.0.0.1:9/s/s1/v1",
                                             "anthropic": "http://127.0.0.1:9/s/s1",
                                             "gemini": "http://127.0.0.1:9/s/s1"},
                                  home="/sessions/s1/home", workspace="/sessions/s1/workspace")
    values.update(overrides)
    return HarnessContext(**values)


@pytest.mark.parametrize("harness", list(ADAPTERS))
def test_unknown_or_ill_typed_settings_are_refused(harness: str) -> None:
    adapter = adapter_for(harness)
    command = "tool {instruction}"
    with pytest.raises(AdapterError, match="unknown agent.settings"):
        adapter.invocation(fake_context(settings={"temperature": 0.2}, command=command))
    with pytest.raises(AdapterError, match="env"):
        adapter.invocation(fake_context(settings={"env": {"A": 1}}, command=command))
    if harness != "command":
        with pytest.raises(AdapterError, match="extra_args"):
            adapter.invocation(fake_context(settings={"extra_args": "--verbose"}))
        with_extras = adapter.invocation(fake_context(settings={"extra_args": ["--verbose"], "env": {"A": "b"}}))
        assert "--verbose" in with_extras.argv and with_extras.env["A"] == "b"


def test_pi_settings_are_checked() -> None:
    pi = adapter_for("pi")
    with pytest.raises(AdapterError, match="'openai' or 'gemini'"):
        pi.invocation(fake_context(settings={"api": "bedrock"}))
    with pytest.raises(AdapterError, match="reasoning"):
        pi.invocation(fake_context(settings={"reasoning": "yes"}))
    models = json.loads(pi.invocation(fake_context(settings={"api": "gemini", "reasoning": True}))
                        .home_files[".pi/agent/models.json"])
    provider = models["providers"]["rollwire"]
    assert provider["api"] == "google-generative-ai" and provider["baseUrl"] == "http://127.0.0.1:9/s/s1/v1beta"
    assert provider["models"][0]["id"] == MODEL and provider["models"][0]["reasoning"] is True


def test_opencode_config_points_at_the_session_and_stays_home() -> None:
    opencode = adapter_for("opencode")
    with pytest.raises(AdapterError, match="'chat' or 'responses'"):
        opencode.invocation(fake_context(settings={"api": "gemini"}))
    invocation = opencode.invocation(fake_context(model="org/odd model", settings={"api": "responses"}))
    config = json.loads(invocation.home_files[".config/opencode/opencode.json"])
    assert config["model"] == config["small_model"] == "rollwire/org/odd model"
    provider = config["provider"]["rollwire"]
    assert provider["npm"] == "@ai-sdk/openai" and list(provider["models"]) == ["org/odd model"]
    assert provider["options"] == {"baseURL": "http://127.0.0.1:9/s/s1/v1", "apiKey": "key-123456"}
    assert config["autoupdate"] is False and config["share"] == "disabled"
    # Every XDG directory (config, data, cache, state) is in the session's HOME; the instruction on stdin.
    assert {invocation.env[f"XDG_{d}_HOME"] for d in ("CONFIG", "DATA", "CACHE", "STATE")} == {
        "/sessions/s1/home/.config", "/sessions/s1/home/.local/share", "/sessions/s1/home/.cache",
        "/sessions/s1/home/.local/state"}
    assert invocation.stdin == "fix it" and "fix it" not in invocation.argv


def test_gemini_cli_pins_the_model_and_stays_home() -> None:
    invocation = adapter_for("gemini-cli").invocation(fake_context(instruction="--help me"))
    assert invocation.env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:9/s/s1"
    assert invocation.env["GEMINI_API_KEY"] == "key-123456"
    argv = invocation.argv
    assert argv[argv.index("-m") + 1] == MODEL and argv[-1] == "--prompt=--help me"
    settings = json.loads(invocation.home_files[".gemini/settings.json"])
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["telemetry"]["enabled"] is False and settings["privacy"]["usageStatisticsEnabled"] is False


def test_codex_config_points_at_the_session_and_stays_home() -> None:
    invocation = adapter_for("codex").invocation(fake_context(model='odd "model"'))
    config = tomllib.loads(invocation.home_files[".codex/config.toml"])
    assert config["model"] == 'odd "model"' and config["model_provider"] == "rollwire"
    provider = config["model_providers"]["rollwire"]
    assert provider["base_url"] == "http://127.0.0.1:9/s/s1/v1" and provider["wire_api"] == "responses"
    assert provider["request_max_retries"] == 0 and config["analytics"]["enabled"] is False
    assert invocation.env[provider["env_key"]] == "key-123456"
    assert invocation.env["CODEX_HOME"] == "/sessions/s1/home/.codex"


def test_claude_code_pins_every_model_slot() -> None:
    env = adapter_for("claude-code").invocation(fake_context()).env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/s/s1" and env["ANTHROPIC_API_KEY"] == "key-123456"
    assert {env[k] for k in env if k.endswith("_MODEL")} == {MODEL}
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"


def test_registry() -> None:
    assert set(ADAPTERS) == {"codex", "claude-code", "qwen-code", "pi", "gemini-cli", "opencode", "command"}
    assert all(adapter_for(name).name == name for name in ADAPTERS)
    assert adapter_for("command").executable() is None
    with pytest.raises(AdapterError, match="unknown harness"):
        adapter_for("aider")
    with pytest.raises(AdapterError, match="needs agent.command"):
        adapter_for("command").invocation(fake_context())
