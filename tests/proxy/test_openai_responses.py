"""OpenAI Responses through the proxy against the stand-in engine, with capture on real Kafka; the
normalizer and the event grammar on their own; and the request bodies recorded from the real Codex CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.standin_engine import render_prompt, tokenize
from proxy.engine import engine_body
from proxy.turns import EngineDelta, EngineTurn, ToolCallDelta
from proxy.errors import BadRequest
from proxy.apis.openai_responses import (
    ResponsesApi,
    ResponsesRenderer,
    custom_arguments,
    normalize,
    parse_request,
)
from proxy.apis.base import Route
from proxy.apis.reasoning import decode_reasoning, encode_reasoning
from schemas.completions import ToolCall, Usage
from tests.proxy.conftest import ProxyUnderTest

CODEX_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "codex"

INPUT = [
    {"type": "message", "id": "msg_1", "role": "developer",
     "content": [{"type": "input_text", "text": "You are a coding agent."}]},
    {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "Make a file."}]},
]
SHELL = {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}
NAMESPACE = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn", "description": "Spawn one",
                        "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]}
HOSTED = [{"type": "web_search", "external_web_access": True}, {"type": "tool_search"}]
HANDSHAKE = {"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
             "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello \"world\"\n*** End Patch\n"


def forced_call(name: str, arguments: dict[str, Any]) -> str:
    """A regex literal for the stand-in (and vLLM) that makes the model emit exactly this tool call."""
    text = '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments, ensure_ascii=False) + \
        '}\n</tool_call>'
    return re.escape(text)


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) pairs; asserts every frame has both lines and that they agree."""
    out = []
    for frame in text.strip().split("\n\n"):
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame[:200]
        data = json.loads(lines[1][6:])
        assert data["type"] == lines[0][7:]
        out.append((lines[0][7:], data))
    return out


def assert_well_formed(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The grammar a real server follows; returns the final response object."""
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    added = {d["output_index"]: d["item"] for k, d in events if k == "response.output_item.added"}
    done = {d["output_index"]: d["item"] for k, d in events if k == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(added)))
    for index, item in added.items():
        assert done[index]["id"] == item["id"] and done[index]["type"] == item["type"]
        mine = [k for k, d in events if d.get("item_id") == item["id"] or d.get("item", {}).get("id") == item["id"]]
        assert mine[0] == "response.output_item.added" and mine[-1] == "response.output_item.done"
        if item["type"] in ("message", "reasoning"):
            assert "response.content_part.added" in mine and "response.content_part.done" in mine
    final = events[-1][1]["response"]
    assert [i["id"] for i in final["output"]] == [done[i]["id"] for i in sorted(done)]
    assert final["usage"]["total_tokens"] == final["usage"]["input_tokens"] + final["usage"]["output_tokens"]
    return final


def post(session: dict, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{session['base_urls']['openai']}/responses", json=body, timeout=30,
                      headers={"authorization": f"Bearer {session['api_key']}"})


def engine_prompt(event: Any) -> list[int]:
    return tokenize(render_prompt(engine_body(event.request, "rollwire-tiny", stream=False)))


# -- through the proxy ------------------------------------------------------------------------------------


@pytest.mark.kafka
async def test_unknown_session_and_websocket_upgrade_are_refused_in_openai_shape(proxy: ProxyUnderTest) -> None:
    body = {"model": "m", "input": "hi"}
    by_path = httpx.post(f"{proxy.url}/s/no-such-session/v1/responses", json=body,
                         headers={"authorization": "Bearer some-key-123"})
    by_key = httpx.post(f"{proxy.url}/v1/responses", json=body, headers={"authorization": "Bearer nope"})
    for response in (by_path, by_key):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    session = proxy.new_session()
    for url in (f"{proxy.url}/v1/responses", f"{session['base_urls']['openai']}/responses"):
        for headers in ({}, HANDSHAKE):  # a plain GET, and a real handshake (a WebSocket scope in ASGI)
            upgrade = httpx.get(url, headers=headers)
            assert upgrade.status_code == 426 and "not WebSocket" in upgrade.json()["error"]["message"]


@pytest.mark.kafka
async def test_whole_reply_is_captured_token_for_token(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(session_id="resp-whole")
    response = post(session, {"model": "gpt-5-codex", "instructions": "Be brief.", "input": INPUT,
                              "max_output_tokens": 12, "store": False, "include": ["reasoning.encrypted_content"],
                              "prompt_cache_key": "k", "text": {"verbosity": "low"}})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["object"] == "response" and reply["id"].startswith("resp_") and reply["model"] == "gpt-5-codex"
    assert reply["status"] == "incomplete" and reply["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = reply["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    text = message["content"][0]["text"]
    [event] = await proxy.completions(1)
    assert event.api == "openai.responses" and event.requested_model == "gpt-5-codex" and event.status == "ok"
    assert [m.role for m in event.request.messages] == ["system", "developer", "user"]
    assert event.request.messages[0].content == "Be brief."
    assert event.prompt_token_ids.tolist() == engine_prompt(event)
    assert event.token_ids.tolist() == list(text.encode())
    assert reply["usage"] == {"input_tokens": len(event.prompt_token_ids), "output_tokens": len(event.token_ids),
                              "total_tokens": len(event.prompt_token_ids) + len(event.token_ids),
                              "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}


@pytest.mark.kafka
async def test_stream_is_well_formed_and_reassembles_to_the_recorded_tokens(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    with httpx.stream("POST", f"{session['base_urls']['openai']}/responses", timeout=30,
                      headers={"authorization": f"Bearer {session['api_key']}"},
                      json={"model": "m", "input": "say something", "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.read().decode())
    final = assert_well_formed(events)
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    [done] = [d["text"] for k, d in events if k == "response.output_text.done"]
    assert done == text == final["output"][0]["content"][0]["text"]
    [event] = await proxy.completions(1)
    assert bytes(event.token_ids.tolist()).decode() == text == event.message.content
    assert final["usage"]["output_tokens"] == len(event.token_ids)
    assert event.request.messages[0].role == "user" and event.request.messages[0].content == "say something"


@pytest.mark.kafka
@pytest.mark.parametrize("stream", [False, True])
async def test_forced_function_call_round_trip_extends_the_prompt(proxy: ProxyUnderTest, stream: bool) -> None:
    arguments = {"cmd": "printf 'hi' > hello.txt"}
    turns = [{"structured_outputs": {"regex": forced_call("exec_command", arguments)}},
             {"structured_outputs": {"regex": re.escape("Done.")}}]
    session = proxy.new_session(engine={"turns": turns})
    body = {"model": "m", "input": INPUT, "tools": [SHELL, *HOSTED], "tool_choice": "auto", "stream": stream,
            "max_output_tokens": 400,
            "parallel_tool_calls": True}
    first = post(session, body)
    assert first.status_code == 200, first.text
    output = assert_well_formed(sse_events(first.text))["output"] if stream else first.json()["output"]
    [call] = output
    assert call["type"] == "function_call" and call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == arguments and call["call_id"]
    if stream:
        events = sse_events(first.text)
        deltas = "".join(d["delta"] for k, d in events if k == "response.function_call_arguments.delta")
        [done] = [d for k, d in events if k == "response.function_call_arguments.done"]
        assert deltas == done["arguments"] == call["arguments"]
    history = [*INPUT, call, {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    second = post(session, {**body, "input": history})
    assert second.status_code == 200, second.text
    output = assert_well_formed(sse_events(second.text))["output"] if stream else second.json()["output"]
    assert output[0]["content"][0]["text"] == "Done."
    one, two = await proxy.completions(2)
    assert [t.name for t in one.request.tools] == ["exec_command"]  # hosted tools dropped
    # The second prompt is the first prompt plus the sampled tokens (then the tool result and a new turn).
    head = one.prompt_token_ids.tolist() + one.token_ids.tolist()
    assert two.prompt_token_ids.tolist()[:len(head)] == head
    assert two.request.messages[-1].role == "tool" and two.request.messages[-1].tool_call_id == call["call_id"]


@pytest.mark.kafka
@pytest.mark.parametrize("stream", [False, True])
async def test_forced_custom_tool_call_round_trip(proxy: ProxyUnderTest, stream: bool) -> None:
    session = proxy.new_session(engine={"turns": [{"structured_outputs": {"regex": forced_call("apply_patch",
                                                                                                {"input": PATCH})}},
                                                  {"structured_outputs": {"regex": re.escape("Patched.")}}]})
    body = {"model": "m", "input": INPUT, "tools": [SHELL, APPLY_PATCH], "stream": stream, "max_output_tokens": 400}
    first = post(session, body)
    assert first.status_code == 200, first.text
    if stream:
        events = sse_events(first.text)
        output = assert_well_formed(events)["output"]
        [delta] = [d["delta"] for k, d in events if k == "response.custom_tool_call_input.delta"]
        [done] = [d["input"] for k, d in events if k == "response.custom_tool_call_input.done"]
        assert delta == done == PATCH
        assert not [k for k, _ in events if k.startswith("response.function_call_arguments")]
    else:
        output = first.json()["output"]
    [call] = output
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch" and call["input"] == PATCH
    history = [*INPUT, call, {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Success."}]
    second = post(session, {**body, "input": history})
    assert second.status_code == 200, second.text
    one, two = await proxy.completions(2)
    [patch_tool] = [t for t in one.request.tools if t.name == "apply_patch"]
    assert patch_tool.kind == "custom" and patch_tool.grammar == APPLY_PATCH["format"]
    assert patch_tool.parameters["required"] == ["input"]
    assert two.request.messages[-2].tool_calls[0].kind == "custom"
    assert two.request.messages[-2].tool_calls[0].arguments == custom_arguments(PATCH)
    head = one.prompt_token_ids.tolist() + one.token_ids.tolist()
    assert two.prompt_token_ids.tolist()[:len(head)] == head


@pytest.mark.kafka
async def test_namespaced_function_is_flattened_and_mapped_back(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(engine={"extra": {"structured_outputs": {"regex": forced_call("agents__spawn",
                                                                                               {"task": "x"})}}})
    response = post(session, {"model": "m", "input": INPUT, "tools": [NAMESPACE], "max_output_tokens": 400})
    assert response.status_code == 200, response.text
    [call] = response.json()["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn", "agents")
    [event] = await proxy.completions(1)
    assert [t.name for t in event.request.tools] == ["agents__spawn"]
    again, _ = normalize(parse_request({"input": [*INPUT, call]}))
    assert again.messages[-1].tool_calls[0].name == "agents__spawn"


@pytest.mark.kafka
async def test_reasoning_in_history_reaches_the_engine_from_encrypted_content(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    thought = "The user wants a file; I will use the shell. ünïcode ✓"
    history = [*INPUT,
               {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encode_reasoning(thought)},
               {"type": "message", "id": "msg_3", "role": "assistant",
                "content": [{"type": "output_text", "text": "Sure."}]},
               {"type": "message", "id": "msg_4", "role": "user", "content": [{"type": "input_text", "text": "go"}]}]
    response = post(session, {"model": "m", "input": history})
    assert response.status_code == 200, response.text
    [event] = await proxy.completions(1)
    assistant = event.request.messages[2]
    assert (assistant.role, assistant.reasoning, assistant.content) == ("assistant", thought, "Sure.")
    assert f"<think>{thought}</think>Sure.".encode() in bytes(event.prompt_token_ids.tolist())


BAD_REQUESTS = [
    ([1, 2], None),
    ({"model": "m"}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "shell_magic"}]}, "input.0.type"),
    ({"input": [{"type": "message", "role": "critic", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]}, "input.0.input"),
    ({"input": [{"type": "reasoning", "encrypted_content": "rwr1.AAAA.0000000000000000"}]},
     "input.0.encrypted_content"),
    ({"input": "hi", "tools": [{"type": "teleport"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [SHELL, SHELL]}, "tools.1"),
    ({"input": "hi", "tools": [SHELL, *HOSTED], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "hi", "tools": [SHELL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "hi", "reasoning": {"effort": "maximal"}}, "reasoning.effort"),
]


@pytest.mark.kafka
async def test_bad_input_is_an_openai_shaped_400(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    for body, param in BAD_REQUESTS:
        response = post(session, body)  # type: ignore[arg-type]
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], body
        assert error["param"] == param, (body, error)
    images = post(session, {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    assert images.status_code == 400 and "text only" in images.json()["error"]["message"]


@pytest.mark.kafka
async def test_engine_failure_mid_stream_is_a_response_failed_event(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(engine={"extra": {"standin_fail": "cut"}})
    with httpx.stream("POST", f"{session['base_urls']['openai']}/responses", timeout=30,
                      headers={"authorization": f"Bearer {session['api_key']}"},
                      json={"model": "m", "input": "hi", "stream": True}) as response:
        assert response.status_code == 200
        events = sse_events(response.read().decode())
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-1][1]["response"]["status"] == "failed" and events[-1][1]["response"]["error"]["message"]
    # The error event keeps the proxy's kind; the failed response's code is one OpenAI's SDKs accept.
    assert events[-2][1]["code"] == "engine_error"
    assert events[-1][1]["response"]["error"]["code"] == "server_error"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


# -- the normalizer and the renderer on their own --------------------------------------------------------


def _turn(**fields: Any) -> EngineTurn:
    values: dict[str, Any] = dict(prompt_token_ids=[1, 2], token_ids=[3, 4, 5], logprobs=[-0.1] * 3, content=None,
                                  reasoning=None, tool_calls=[], finish_reason="stop",
                                  usage=Usage(prompt_tokens=2, completion_tokens=3))
    values.update(fields)
    return EngineTurn(**values)


def test_reasoning_encrypted_content_round_trips_to_the_same_text() -> None:
    wire = parse_request({"model": "m", "input": INPUT, "include": ["reasoning.encrypted_content"],
                          "tools": [SHELL, APPLY_PATCH]})
    request, tools = normalize(wire)
    thought = "Let me think.\nA patch, with \"quotes\" and ✓."
    turn = _turn(reasoning=thought, content="ok",
                 tool_calls=[ToolCall(id="call_a", name="apply_patch", arguments=custom_arguments(PATCH)),
                             ToolCall(id="call_b", name="exec_command", arguments='{"cmd": "ls"}')])
    output = ResponsesRenderer(wire, tools).response(turn)["output"]
    assert [o["type"] for o in output] == ["reasoning", "message", "custom_tool_call", "function_call"]
    assert decode_reasoning(output[0]["encrypted_content"], param="x") == thought
    assert output[2]["input"] == PATCH
    # Echoed back, the items fold into the one assistant turn the engine produced.
    history = [*INPUT, *output, {"type": "custom_tool_call_output", "call_id": "call_a", "output": "done"},
               {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "x"}]}]
    again, _ = normalize(parse_request({"input": history, "tools": [SHELL, APPLY_PATCH]}))
    assistant = again.messages[2]
    assert (assistant.reasoning, assistant.content) == (thought, "ok")
    assert [(c.name, c.kind, c.arguments) for c in assistant.tool_calls] == [
        ("apply_patch", "custom", custom_arguments(PATCH)), ("exec_command", "function", '{"cmd": "ls"}')]
    assert [m.role for m in again.messages[3:]] == ["tool", "tool"]
    # Without include, no encrypted_content; the reasoning still comes back through its reasoning_text.
    plain = ResponsesRenderer(parse_request({"input": "x"}), tools).response(turn)["output"][0]
    assert "encrypted_content" not in plain
    again, _ = normalize(parse_request({"input": [plain, {"role": "user", "content": "next"}]}))
    assert again.messages[0].reasoning == thought
    # Someone else's encrypted_content is dropped, not an error.
    foreign, _ = normalize(parse_request({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                                                    {"role": "user", "content": "hi"}]}))
    assert [m.role for m in foreign.messages] == ["user"]
    assert request.messages[0].role == "developer"


def test_streamed_reasoning_text_and_calls_follow_the_event_grammar() -> None:
    wire = parse_request({"model": "m", "input": "x", "stream": True, "include": ["reasoning.encrypted_content"],
                          "tools": [SHELL, APPLY_PATCH, NAMESPACE]})
    _, tools = normalize(wire)
    renderer = ResponsesRenderer(wire, tools)
    deltas = [EngineDelta(), EngineDelta(reasoning="Hmm, "), EngineDelta(reasoning="a patch."),
              EngineDelta(content="Doing it."),
              EngineDelta(tool_calls=[ToolCallDelta(0, "call_1", "apply_patch", "")]),
              EngineDelta(tool_calls=[ToolCallDelta(0, None, None, custom_arguments(PATCH)[:10])]),
              EngineDelta(tool_calls=[ToolCallDelta(0, None, None, custom_arguments(PATCH)[10:])]),
              EngineDelta(tool_calls=[ToolCallDelta(1, "call_2", "agents__spawn", '{"task":'),
                                      ToolCallDelta(1, None, None, ' "y"}')])]
    chunks = [c for d in deltas for c in renderer.stream_delta(d)]
    held = b"".join(chunks)
    assert b"response.output_item.done" in held and b"custom_tool_call_input" not in held
    assert held.count(b"event: response.output_item.done") == 2  # reasoning and message; the calls wait
    turn = _turn(reasoning="Hmm, a patch.", content="Doing it.", finish_reason="tool_calls")
    events = sse_events(b"".join(chunks + renderer.stream_finish(turn)).decode())
    final = assert_well_formed(events)
    reasoning, message, patch, spawn = final["output"]
    assert decode_reasoning(reasoning["encrypted_content"], param="x") == "Hmm, a patch."
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm, a patch."}]
    assert message["content"][0]["text"] == "Doing it."
    assert (patch["type"], patch["input"], patch["call_id"]) == ("custom_tool_call", PATCH, "call_1")
    assert (spawn["name"], spawn["namespace"], spawn["arguments"]) == ("spawn", "agents", '{"task": "y"}')
    assert final["status"] == "completed"


def test_whole_stream_for_a_whole_engine_turn() -> None:
    wire = parse_request({"input": "x", "stream": True, "tools": [SHELL]})
    _, tools = normalize(wire)
    turn = _turn(content="hi", tool_calls=[ToolCall(id="c", name="exec_command", arguments="{}")],
                 finish_reason="length")
    final = assert_well_formed(sse_events(b"".join(ResponsesRenderer(wire, tools).stream_whole(turn)).decode()))
    assert final["status"] == "incomplete" and [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert [o["status"] for o in final["output"]] == ["completed", "incomplete"]  # the call was cut off


def test_tool_choice_and_effort_map_to_the_engine_form() -> None:
    request, _ = normalize(parse_request({"input": "x", "tools": [SHELL, APPLY_PATCH, NAMESPACE],
                                          "tool_choice": {"type": "custom", "name": "apply_patch"},
                                          "reasoning": {"effort": "xhigh", "summary": "auto"}}))
    assert request.tool_choice == {"type": "function", "function": {"name": "apply_patch"}}
    assert request.reasoning_effort == "high"
    request, _ = normalize(parse_request({"input": "x", "tools": [NAMESPACE],
                                          "tool_choice": {"type": "function", "name": "spawn", "namespace": "agents"},
                                          "reasoning": {"effort": "none"}}))
    assert request.tool_choice == {"type": "function", "function": {"name": "agents__spawn"}}
    assert request.reasoning_effort is None
    with pytest.raises(BadRequest):
        decode_reasoning(encode_reasoning("abc")[:-1] + "0", param="x")


# -- what the real Codex CLI sends ---------------------------------------------------------------------------


def _codex_fixtures() -> list[Path]:
    return sorted(CODEX_FIXTURES.glob("*.json"))


def test_codex_fixtures_exist() -> None:
    assert len(_codex_fixtures()) >= 2, "record them with tests/fixtures/harnesses/record_codex.py"


@pytest.mark.parametrize("path", _codex_fixtures(), ids=lambda p: p.stem)
def test_codex_request_bodies_normalize(path: Path) -> None:
    """A Codex upgrade that changes its wire format fails here first (re-record with record_codex.py)."""
    recorded = json.loads(path.read_text())
    body = recorded["body"]
    call = ResponsesApi().parse(body, Route())
    request = call.request
    assert call.stream is True and body["store"] is False and "reasoning.encrypted_content" in body["include"]
    assert "instructions" not in body and request.messages[0].role == "developer"
    assert len([m for m in request.messages if m.role == "assistant"]) == recorded["assistant_turns"]
    # Every tool the engine can run is offered, namespaces flattened; hosted tools are not.
    expected = set()
    for tool in body["tools"]:
        if tool["type"] in ("function", "custom"):
            expected.add(tool["name"])
        elif tool["type"] == "namespace":
            expected |= {f"{tool['name']}__{nested['name']}" for nested in tool["tools"]}
        else:
            assert tool["type"] in ("web_search", "tool_search"), tool["type"]
    assert {t.name for t in request.tools} == expected and "exec_command" in expected
    assert "web_search" in {t["type"] for t in body["tools"]}
    for tool in (t for t in body["tools"] if t["type"] == "custom"):
        [definition] = [t for t in request.tools if t.name == tool["name"]]
        assert definition.kind == "custom" and definition.grammar == tool["format"]
    # History items: calls echoed with the arguments the engine saw; results answer them in order.
    echoed = [c for m in request.messages for c in m.tool_calls]
    items = [i for i in body["input"] if i.get("type") in ("function_call", "custom_tool_call")]
    assert [c.id for c in echoed] == [i["call_id"] for i in items]
    for item, tool_call in zip(items, echoed):
        if item["type"] == "custom_tool_call":
            assert tool_call.kind == "custom" and tool_call.arguments == custom_arguments(item["input"])
        else:
            assert tool_call.arguments == item["arguments"]
    results = [m.tool_call_id for m in request.messages if m.role == "tool"]
    assert results == [c.id for c in echoed][:len(results)]
    assert engine_body(request, "served", stream=True)["messages"][0]["role"] == "system"
