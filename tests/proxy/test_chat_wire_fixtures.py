"""What Qwen Code and Pi really send, through the Chat Completions normalizer.

The bodies under ``tests/fixtures/harnesses/{qwen-code,pi}/`` are the three calls of each CLI's scripted
tool session (two tool calls, then the answer), recorded by ``tests/fixtures/harnesses/record_chat.py``
with the pinned versions of ``producers/harness_install.py``. These tests pin down the wire each CLI
speaks (roles, content forms, tool definitions, how tool results and tool calls come back, token limits,
stream options) and what ``parse_request`` + ``normalize`` make of it, so that a CLI upgrade that changes
its wire format fails here once the fixtures are re-recorded.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from producers.harness_install import HARNESSES
from proxy.engine import engine_body
from proxy.errors import BadRequest
from proxy.apis.openai_chat import ChatRenderer, normalize, parse_request
from schemas.completions import ContentPart, NormalizedRequest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses"
CLIS = ("qwen-code", "pi")


def _recorded(cli: str) -> list[dict[str, Any]]:
    documents = [json.loads(p.read_text()) for p in sorted((FIXTURES / cli).glob("call_*.json"))]
    assert [d["call"] for d in documents] == [0, 1, 2], f"{cli}: expected calls 0-2, re-record the fixtures"
    return documents


def _bodies(cli: str) -> list[dict[str, Any]]:
    return [d["body"] for d in _recorded(cli)]


def _normalized(body: dict[str, Any]) -> NormalizedRequest:
    return normalize(parse_request(copy.deepcopy(body)))


def _text(content: str | list[ContentPart] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""


# -- both CLIs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cli", CLIS)
def test_fixtures_were_recorded_with_the_pinned_version(cli: str) -> None:
    spec = HARNESSES[cli]
    assert {d["package"] for d in _recorded(cli)} == {f"{spec.package}@{spec.version}"}


@pytest.mark.parametrize("cli", CLIS)
def test_every_recorded_call_normalizes_message_for_message(cli: str) -> None:
    for body in _bodies(cli):
        request = _normalized(body)
        assert [m.role for m in request.messages] == [m["role"] for m in body["messages"]]
        assert request.stream is True
        assert {t.name for t in request.tools} == {t["function"]["name"] for t in body["tools"]}
        assert all(t.kind == "function" for t in request.tools)
        for wire, tool in zip(body["tools"], request.tools):
            assert tool.parameters == wire["function"].get("parameters")  # absent when a tool takes none
        assert request.tool_choice is None and request.sampling.temperature is None  # the CLIs leave them unset


@pytest.mark.parametrize("cli", CLIS)
def test_streams_are_asked_with_usage(cli: str) -> None:
    """Both ask for the usage chunk; the renderer must then send one after the finish_reason chunk."""
    for body in _bodies(cli):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert ChatRenderer(parse_request(copy.deepcopy(body))).include_usage


@pytest.mark.parametrize("cli", CLIS)
def test_history_is_append_only(cli: str) -> None:
    """Each call repeats the previous call's messages unchanged and adds the assistant turn and its tool
    result: what lets a later prompt extend an earlier one token for token."""
    bodies = _bodies(cli)
    for earlier, later in zip(bodies, bodies[1:]):
        assert later["messages"][:len(earlier["messages"])] == earlier["messages"]
        assert [m["role"] for m in later["messages"][len(earlier["messages"]):]] == ["assistant", "tool"]
        assert later["tools"] == earlier["tools"]


@pytest.mark.parametrize("cli", CLIS)
def test_tool_calls_come_back_with_compact_arguments_and_no_content(cli: str) -> None:
    """The CLIs parse the arguments they got and send them back through JSON.stringify (no spaces), with
    ``content: null`` beside the calls; the normalizer keeps the argument text as sent."""
    body = _bodies(cli)[2]
    assistants = [m for m in body["messages"] if m["role"] == "assistant"]
    assert len(assistants) == 2
    request = _normalized(body)
    normalized = [m for m in request.messages if m.role == "assistant"]
    for k, (wire, message) in enumerate(zip(assistants, normalized)):
        assert wire["content"] is None and "reasoning_content" not in wire
        (call,) = wire["tool_calls"]
        assert call["id"] == f"call_{k}_0" and call["type"] == "function"
        arguments = call["function"]["arguments"]
        assert isinstance(arguments, str)
        assert arguments == json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
        assert message.content is None and message.reasoning is None
        assert [(c.id, c.name, c.arguments, c.kind) for c in message.tool_calls] == [
            (call["id"], call["function"]["name"], arguments, "function")]


@pytest.mark.parametrize("cli", CLIS)
def test_tool_results_answer_their_call_by_id(cli: str) -> None:
    request = _normalized(_bodies(cli)[2])
    calls = [c.id for m in request.messages for c in m.tool_calls]
    results = [m for m in request.messages if m.role == "tool"]
    assert [m.tool_call_id for m in results] == calls == ["call_0_0", "call_1_0"]
    assert all(_text(m.content) and m.is_error is None for m in results)


@pytest.mark.parametrize("cli", CLIS)
def test_a_tool_message_without_its_call_id_is_refused(cli: str) -> None:
    body = copy.deepcopy(_bodies(cli)[1])
    index = next(i for i, m in enumerate(body["messages"]) if m["role"] == "tool")
    del body["messages"][index]["tool_call_id"]
    with pytest.raises(BadRequest) as caught:
        _normalized(body)
    assert caught.value.param == f"messages.{index}.tool_call_id"


@pytest.mark.parametrize("cli", CLIS)
def test_engine_body_keeps_the_conversation(cli: str) -> None:
    """What vLLM gets for the last recorded call: every message, the tool calls with the CLI's argument
    text and their ids, the tool results, the CLI's token limit and every offered tool."""
    body = _bodies(cli)[2]
    sent = engine_body(_normalized(body), "rollwire-tiny", stream=True)
    assert [m["role"] for m in sent["messages"]] == [
        "system" if m["role"] == "developer" else m["role"] for m in body["messages"]]
    assert [c for m in sent["messages"] for c in m.get("tool_calls", ())] == [
        c for m in body["messages"] for c in m.get("tool_calls") or ()]
    assert [m["tool_call_id"] for m in sent["messages"] if m["role"] == "tool"] == ["call_0_0", "call_1_0"]
    assert sent["max_tokens"] == body.get("max_completion_tokens", body.get("max_tokens"))
    assert len(sent["tools"]) == len(body["tools"]) and all(t["function"]["parameters"] for t in sent["tools"])
    assert sent["stream_options"] == {"include_usage": True} and sent["return_token_ids"] and sent["logprobs"]


# -- Qwen Code ---------------------------------------------------------------------------------------

def test_qwen_code_wire() -> None:
    """System prompt as a string; one user message of text parts (four <system-reminder> parts: skills,
    environment, deferred tools, date; then the prompt); ``max_tokens``, not max_completion_tokens; no
    store or reasoning fields."""
    first = _bodies("qwen-code")[0]
    assert sorted(first) == ["max_tokens", "messages", "model", "stream", "stream_options", "tools"]
    assert first["max_tokens"] == 32768
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert isinstance(first["messages"][0]["content"], str)
    parts = first["messages"][1]["content"]
    assert isinstance(parts, list) and {p["type"] for p in parts} == {"text"} and len(parts) == 5
    assert all(p["text"].startswith("<system-reminder>") for p in parts[:-1])
    request = _normalized(first)
    assert request.sampling.max_tokens == 32768
    assert isinstance(request.messages[0].content, str) and request.messages[0].content.startswith("You are Qwen Code")
    user = request.messages[1].content
    assert isinstance(user, list) and [p.type for p in user] == ["text"] * 5
    assert user[-1].text.startswith("Create notes.txt") and "{WORKSPACE}" in user[1].text


def test_qwen_code_tools() -> None:
    request = _normalized(_bodies("qwen-code")[0])
    tools = {t.name: t for t in request.tools}
    assert {"write_file", "run_shell_command", "edit", "read_file", "glob", "grep_search"} <= set(tools)
    assert tools["get_goal"].parameters is None  # sent without "parameters"; the engine body fills in {}
    assert tools["write_file"].parameters["required"] == ["file_path", "content"]
    assert tools["run_shell_command"].parameters["required"] == ["command"]
    assert set(tools["edit"].parameters["required"]) >= {"file_path", "old_string", "new_string"}


def test_qwen_code_tool_results_are_text_parts() -> None:
    body = _bodies("qwen-code")[2]
    results = [m for m in body["messages"] if m["role"] == "tool"]
    assert all(isinstance(m["content"], list) and [p["type"] for p in m["content"]] == ["text"] for m in results)
    normalized = [m for m in _normalized(body).messages if m.role == "tool"]
    assert [type(m.content) for m in normalized] == [list, list]
    assert _text(normalized[0].content).startswith("Successfully created and wrote to new file: {WORKSPACE}/notes.txt")
    assert "Exit Code: 0" in _text(normalized[1].content)


def test_qwen_code_reasoning_echo() -> None:
    """Not recorded live (no engine here streams reasoning). Qwen Code 0.24.4 (its OpenAI converter) echoes
    a turn's reasoning as ``reasoning_content`` on the assistant message, with ``content: ""`` instead of
    null when there is reasoning but no text; the normalizer keeps it as the message's reasoning."""
    body = copy.deepcopy(_bodies("qwen-code")[1])
    assistant = next(m for m in body["messages"] if m["role"] == "assistant")
    assistant.update(content="", reasoning_content="The file must exist first.")
    message = next(m for m in _normalized(body).messages if m.role == "assistant")
    assert message.reasoning == "The file must exist first." and message.content == ""
    assert [c.name for c in message.tool_calls] == ["write_file"]


# -- Pi ----------------------------------------------------------------------------------------------

def test_pi_wire() -> None:
    """A reasoning model: the system prompt as a ``developer`` message, ``reasoning_effort``,
    ``max_completion_tokens`` (the model's maxTokens) and ``store: false``; the user prompt as text parts."""
    first = _bodies("pi")[0]
    assert sorted(first) == ["max_completion_tokens", "messages", "model", "reasoning_effort", "store", "stream",
                             "stream_options", "tools"]
    assert first["store"] is False and first["max_completion_tokens"] == 4096
    assert [m["role"] for m in first["messages"]] == ["developer", "user"]
    assert isinstance(first["messages"][0]["content"], str)
    assert first["messages"][1]["content"] == [{"type": "text", "text": first["messages"][1]["content"][0]["text"]}]
    request = _normalized(first)
    assert request.sampling.max_tokens == 4096
    assert request.reasoning_effort == "medium"
    assert request.messages[0].role == "developer"
    assert "Current working directory: {WORKSPACE}" in request.messages[0].content


def test_pi_tools() -> None:
    body = _bodies("pi")[0]
    assert [t["function"]["name"] for t in body["tools"]] == ["read", "bash", "edit", "write"]
    assert all(t["function"]["strict"] is False for t in body["tools"])  # an extra field the wire model keeps
    tools = {t.name: t for t in _normalized(body).tools}
    assert tools["bash"].parameters["required"] == ["command"]
    assert tools["write"].parameters["required"] == ["path", "content"]
    assert tools["edit"].parameters["properties"]["edits"]["type"] == "array"


def test_pi_tool_results_are_strings() -> None:
    body = _bodies("pi")[2]
    results = [m for m in body["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in results] == ["(no output)", "Successfully replaced 1 block(s) in notes.txt."]
    normalized = [m for m in _normalized(body).messages if m.role == "tool"]
    assert [m.content for m in normalized] == [m["content"] for m in results]


def test_pi_reasoning_echo() -> None:
    """Not recorded live (no engine here streams reasoning). Pi 0.73.1 echoes reasoning back under the
    field name it arrived in (the proxy streams ``reasoning_content``), beside string content."""
    body = copy.deepcopy(_bodies("pi")[1])
    assistant = next(m for m in body["messages"] if m["role"] == "assistant")
    assistant["reasoning_content"] = "Write the file with bash."
    message = next(m for m in _normalized(body).messages if m.role == "assistant")
    assert message.reasoning == "Write the file with bash." and [c.name for c in message.tool_calls] == ["bash"]
    sent = engine_body(_normalized(body), "rollwire-tiny", stream=True)
    assert next(m for m in sent["messages"] if m["role"] == "assistant")["reasoning"] == "Write the file with bash."
