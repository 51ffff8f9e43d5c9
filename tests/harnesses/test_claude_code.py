"""The real Claude Code CLI (``@anthropic-ai/claude-code``, pinned in producers/harness_install.py) runs
through the proxy on the Anthropic Messages API: a text-only session and a multi-turn tool session in
which the model calls Claude Code's own Write and Bash tools, Claude Code runs them (the file appears in
its workspace), sends the results back and ends on a text answer, exit code 0.

Every call is a completion event (api ``anthropic.messages``) with token ids; every request was streamed
(Claude Code silently repeats a request without streaming when it dislikes a stream, so a non-streamed
request or an extra call fails here); each call's prompt extends the previous prompt plus its sampled
tokens (on the real engine: the previous prompt token for token, then the sampled text). The model's
output is scripted by the session's ``engine.turns`` (forced through
``structured_outputs.regex``): on the stand-in engine (fast) and on the real vLLM CPU server.

The recorded request bodies (``tests/fixtures/harnesses/claude-code/``, written by
``record_claude_code.py`` beside them) are parsed by ``MessagesApi`` here too, so a CLI upgrade that
changes the wire format fails a test even where the CLI cannot run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producers.harness_install import HARNESSES
from proxy.apis.anthropic_messages import BILLING_PREFIX, MessagesApi
from proxy.apis.base import Route
from tests.harnesses.claude_code_runs import (
    FIXTURES, INSTRUCTION, MODEL, ClaudeRun, run_claude, text_script, tool_script)
from tests.harnesses.common import (
    assert_calls_recorded as assert_events_recorded,
    assert_files_written,
    assert_no_server_errors,
    assert_prefix_chain,
    assert_prompt_text_chain,
    standin_proxy,  # noqa: F401  (fixture)
    vllm_proxy,  # noqa: F401  (fixture)
)
from tests.proxy.conftest import ProxyUnderTest
from tests.proxy.conftest import standin_url  # noqa: F401  (the stand-in engine fixture, module-scoped)


# -- what every session must show --------------------------------------------------------------------

def assert_finished(run: ClaudeRun) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = run.result()
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert result["result"] == run.script.answer
    assert result["num_turns"] == run.script.calls
    assert_files_written(run, run.script, "Claude Code")


def assert_calls_recorded(run: ClaudeRun) -> None:
    """One ok, streamed event per scripted turn (no retry, no non-streaming repeat, no side call)."""
    assert_events_recorded(run, "anthropic.messages", run.script.calls, min_prompt_tokens=1000)
    for event in run.events:
        assert event.requested_model == MODEL
        assert event.request.stream is True and json.loads(event.request_body)["stream"] is True
        assert event.agent_hints.get("user-agent", "").startswith("claude-cli/")
        assert BILLING_PREFIX not in (event.request.messages[0].content or "")


def assert_tool_round_trips(run: ClaudeRun) -> None:
    for k, step in enumerate(run.script.steps):
        event, following = run.events[k], run.events[k + 1]
        assert event.finish_reason == "tool_calls"
        [call] = event.message.tool_calls
        assert call.name == step.name and json.loads(call.arguments) == step.arguments
        answered = [m for m in following.request.messages if m.role == "tool" and m.tool_call_id == call.id]
        assert len(answered) == 1 and answered[0].content and not answered[0].is_error, answered
        echoed = [c for m in following.request.messages for c in m.tool_calls if c.id == call.id]
        assert len(echoed) == 1 and echoed[0].arguments == call.arguments
    last = run.events[-1]
    assert last.finish_reason == "stop" and last.message.content == run.script.answer


# -- wire shape, compared with the recorded fixtures -------------------------------------------------

def wire_shape(body: dict[str, Any]) -> dict[str, Any]:
    """What a request looks like on the wire without its text: fields, each message's role and block
    types, the system blocks, tools and their fields, thinking. Equal shapes: the normalizer sees the same."""
    def blocks(content: Any) -> Any:
        if isinstance(content, list):
            return [(b.get("type"), sorted(b)) for b in content]
        return type(content).__name__

    return {
        "fields": sorted(body),
        "system": blocks(body.get("system")),
        "messages": [{"role": m.get("role"), "content": blocks(m.get("content"))} for m in body.get("messages", [])],
        "tools": sorted(t.get("name", "?") for t in body.get("tools") or ()),
        "tool_fields": sorted({key for t in body.get("tools") or () for key in t}),
        "thinking": body.get("thinking"),
        "stream": body.get("stream"),
    }


def fixture_bodies() -> list[dict[str, Any]]:
    return [json.loads(path.read_text())["body"] for path in sorted(FIXTURES.glob("call_*.json"))]


def assert_wire_matches_fixtures(run: ClaudeRun) -> None:
    recorded = fixture_bodies()
    assert len(recorded) == run.script.calls, (
        "re-record: python tests/fixtures/harnesses/claude-code/record_claude_code.py")
    for event, body in zip(run.events, recorded):
        assert wire_shape(json.loads(event.request_body)) == wire_shape(body), (
            f"Claude Code call {event.sequence} changed its wire format; re-record the fixtures "
            "(tests/fixtures/harnesses/claude-code/record_claude_code.py) and check the fixture tests")


# -- the recorded fixtures, parsed (no CLI needed) ---------------------------------------------------

def test_fixtures_are_of_the_pinned_version() -> None:
    spec = HARNESSES["claude-code"]
    files = sorted(FIXTURES.glob("call_*.json"))
    assert len(files) == 3
    for path in files:
        recorded = json.loads(path.read_text())
        assert recorded["package"] == f"{spec.package}@{spec.version}", "re-record after a version change"


def test_recorded_bodies_normalize() -> None:
    """What the normalizer makes of Claude Code's real requests: the billing line is dropped, the
    system prompt is one message, the Write/Bash round trips become tool messages, nothing refused."""
    api = MessagesApi()
    parsed = [api.parse(body, Route(query={"beta": "true"})) for body in fixture_bodies()]
    first, second, last = (p.request for p in parsed)
    for call, body in zip(parsed, fixture_bodies()):
        request = call.request
        assert call.requested_model == MODEL and request.stream is True
        assert body["system"][0]["text"].startswith(BILLING_PREFIX)
        assert request.messages[0].role == "system" and BILLING_PREFIX not in request.messages[0].content
        assert {"Bash", "Write", "Read", "Edit"} <= {t.name for t in request.tools}
        assert all(t.parameters and t.parameters.get("type") == "object" for t in request.tools)
        deferred = {t["name"] for t in body["tools"] if t.get("defer_loading")}
        assert not deferred & {t.name for t in request.tools}
        assert request.sampling.max_tokens == body["max_tokens"]
    assert [m.role for m in first.messages] == ["system", "user"]
    assert first.messages[1].content[-1].text == INSTRUCTION
    assert [m.role for m in second.messages] == ["system", "user", "assistant", "tool"]
    assert [m.role for m in last.messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    [write] = second.messages[2].tool_calls
    assert write.name == "Write" and json.loads(write.arguments)["content"] == "alpha\n"
    assert second.messages[3].tool_call_id == write.id and "notes.txt" in second.messages[3].content
    [bash] = last.messages[4].tool_calls
    assert bash.name == "Bash" and last.messages[5].tool_call_id == bash.id
    # history is append-only: each request's messages start with the previous request's
    assert second.messages[:2] == first.messages[:2] and last.messages[:4] == second.messages[:4]


# -- live sessions -----------------------------------------------------------------------------------

@pytest.mark.kafka
async def test_text_session_against_standin(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:  # noqa: F811
    run = await run_claude(standin_proxy, tmp_path, text_script, max_tokens=256, seed=5)
    assert_finished(run)
    assert_calls_recorded(run)
    assert run.events[0].finish_reason == "stop" and not run.events[0].message.tool_calls
    assert_no_server_errors(standin_proxy, "anthropic.messages", 1)


@pytest.mark.kafka
async def test_tool_session_against_standin(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:  # noqa: F811
    # max_tokens covers the longest forced text: the stand-in samples one token per byte.
    run = await run_claude(standin_proxy, tmp_path, tool_script, max_tokens=512, seed=7)
    assert_finished(run)
    assert_calls_recorded(run)
    assert_tool_round_trips(run)
    assert_prefix_chain(run)
    assert_no_server_errors(standin_proxy, "anthropic.messages", run.script.calls)
    assert_wire_matches_fixtures(run)


@pytest.mark.kafka
async def test_tool_session_against_real_vllm(vllm_proxy: ProxyUnderTest, vllm_url: str,  # noqa: F811
                                              tmp_path: Path) -> None:
    """The same session on the real engine: guided decoding forces the text, vLLM's hermes parser turns
    the <tool_call> blocks into tool calls, Claude Code runs them."""
    run = await run_claude(vllm_proxy, tmp_path, tool_script, max_tokens=256, seed=11)
    assert_finished(run)
    assert_calls_recorded(run)
    assert_tool_round_trips(run)
    assert_prompt_text_chain(run, vllm_url)
    assert_no_server_errors(vllm_proxy, "anthropic.messages", run.script.calls)
