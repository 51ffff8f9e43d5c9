"""Qwen Code and Pi (Chat Completions CLIs) run multi-turn tool sessions through the proxy: the model calls
the CLI's own tools, the CLI runs them (files appear in its workspace), sends the results back, and ends
on a text answer; every call is a completion event with token ids that extends the previous call's
tokens.

The model's output is scripted by the session's ``engine.turns``: turn N (a call whose prompt holds N
assistant messages) is forced through ``structured_outputs.regex`` to a literal, a hermes
``<tool_call>`` block for tool turns and plain text for the last. The stand-in engine serves the fast
sessions of both CLIs; Qwen Code also runs against the real vLLM CPU server, whose hermes parser turns
the forced text into tool calls. Each CLI runs with only loopback (``tests.harnesses.isolation``).

The request bodies of each session are also checked against the recorded wire fixtures
(``tests/fixtures/harnesses/<cli>/``, written by ``record_chat.py``): a CLI upgrade that changes what it
sends fails here, and the fixtures' own tests say what the normalizer makes of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harnesses.chat_runs import FIXTURES, MODEL, PI, QWEN, ChatCli, ChatRun, run_scripted_session
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

pytestmark = pytest.mark.kafka


# -- what every scripted session must show -----------------------------------------------------------

def assert_cli_finished(run: ChatRun) -> None:
    """Exit 0, the files the tools were told to write, and the final answer in the CLI's output."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "API Error" not in run.stdout, run.stdout[-3000:]
    assert_files_written(run, run.script, run.cli.name)
    assert run.script.answer in run.stdout


def assert_client_saw_no_errors(run: ChatRun) -> None:
    """Qwen Code's own account (``-o json``): as many API requests as scripted turns, none failed. A stream
    without a finish_reason would show up here as retried requests (it retries twice, then gives up
    silently with exit 0). Pi's ``-p`` prints only the answer, checked by assert_cli_finished."""
    if run.cli is not QWEN:
        return
    result = next(item for item in json.loads(run.stdout) if item.get("type") == "result")
    assert result["is_error"] is False and result["result"] == run.script.answer
    api = result["stats"]["models"][MODEL]["api"]
    assert (api["totalRequests"], api["totalErrors"]) == (run.script.calls, 0), api


def assert_calls_recorded(run: ChatRun) -> None:
    """One ok completion event per scripted turn, each with token ids and one logprob per sampled token;
    no extra call (a retry, a side call) and no retry marker."""
    assert_events_recorded(run, "openai.chat", run.script.calls, min_prompt_tokens=100)
    for event in run.events:
        assert event.request_body is not None


def assert_tool_round_trips(run: ChatRun) -> None:
    """Turn k called the scripted tool and its finish reason said so; the CLI answered that call (by id)
    in call k+1, whose prompt holds k+1 assistant messages; the last turn ended on the scripted text."""
    events = sorted(run.events, key=lambda e: e.sequence)
    for k, step in enumerate(run.script.steps):
        event, following = events[k], events[k + 1]
        assert event.finish_reason == "tool_calls"
        assert event.message is not None and len(event.message.tool_calls) == 1
        call = event.message.tool_calls[0]
        assert call.name == step.name and json.loads(call.arguments) == step.arguments
        assert sum(m.role == "assistant" for m in following.request.messages) == k + 1
        answered = [m for m in following.request.messages if m.role == "tool" and m.tool_call_id == call.id]
        assert len(answered) == 1, f"call {k + 1} does not answer tool call {call.id}"
        assert answered[0].content, "empty tool result"
        echoed = [c for m in following.request.messages for c in m.tool_calls if c.id == call.id]
        assert len(echoed) == 1 and json.loads(echoed[0].arguments) == step.arguments
    last = events[-1]
    assert last.finish_reason == "stop"
    assert last.message is not None and last.message.content == run.script.answer and not last.message.tool_calls


# -- wire shape, compared with the recorded fixtures -------------------------------------------------

def wire_shape(body: dict[str, Any]) -> dict[str, Any]:
    """What a CLI's request looks like on the wire, without its text: top-level fields, each message's
    role, fields and content form, the tools offered. Equal shapes mean the normalizer sees the same wire."""
    def content_form(content: Any) -> Any:
        if isinstance(content, list):
            return sorted({part.get("type", "?") for part in content})
        return type(content).__name__

    return {
        "fields": sorted(body),
        "messages": [{"role": m.get("role"), "fields": sorted(m), "content": content_form(m.get("content"))}
                     for m in body.get("messages", [])],
        "tools": sorted(t.get("function", {}).get("name", "?") for t in body.get("tools") or ()),
        "tool_fields": sorted({key for t in body.get("tools") or () for key in t.get("function", {})}),
        "stream_options": body.get("stream_options"),
    }


def fixture_bodies(cli: str) -> list[dict[str, Any]]:
    """The recorded request bodies of ``cli``'s scripted session, in call order."""
    return [json.loads(path.read_text())["body"] for path in sorted((FIXTURES / cli).glob("call_*.json"))]


def assert_wire_matches_fixtures(run: ChatRun) -> None:
    recorded = fixture_bodies(run.cli.name)
    assert len(recorded) == run.script.calls, "re-record: python tests/fixtures/harnesses/record_chat.py"
    for event, body in zip(sorted(run.events, key=lambda e: e.sequence), recorded):
        live = json.loads(event.request_body)
        assert wire_shape(live) == wire_shape(body), (
            f"{run.cli.name} call {event.sequence} changed its wire format; re-record the fixtures "
            f"(tests/fixtures/harnesses/record_chat.py) and check tests/proxy/test_chat_wire_fixtures.py")


# -- the sessions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cli", [QWEN, PI], ids=lambda cli: cli.name)
async def test_scripted_tool_session_against_standin(cli: ChatCli, standin_proxy: ProxyUnderTest,  # noqa: F811
                                                     tmp_path: Path) -> None:
    # max_tokens covers the longest forced text: the stand-in samples one token per byte.
    run = await run_scripted_session(standin_proxy, cli, tmp_path, max_tokens=512, seed=7)
    assert_cli_finished(run)
    assert_client_saw_no_errors(run)
    assert_calls_recorded(run)
    assert_tool_round_trips(run)
    assert_prefix_chain(run)
    assert_no_server_errors(standin_proxy, "openai.chat", run.script.calls)
    assert_wire_matches_fixtures(run)


async def test_qwen_code_scripted_tool_session_against_real_vllm(vllm_proxy: ProxyUnderTest, vllm_url: str,
                                                                tmp_path: Path) -> None:
    """The same session on the real engine: vLLM's guided decoding forces the text, its hermes parser
    turns the <tool_call> block into tool calls, and Qwen Code runs them."""
    run = await run_scripted_session(vllm_proxy, QWEN, tmp_path, max_tokens=256, seed=11)
    assert_cli_finished(run)
    assert_client_saw_no_errors(run)
    assert_calls_recorded(run)
    assert_tool_round_trips(run)
    assert_prompt_text_chain(run, vllm_url)
    assert_no_server_errors(vllm_proxy, "openai.chat", run.script.calls)
