"""Anthropic Messages through the proxy against the stand-in engine, with capture on real Kafka: whole
replies and the SSE event grammar token for token, tool use and thinking round trips, errors in
Anthropic's shape, count_tokens, and the normalizer on its own."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.standin_engine import render_prompt, tokenize
from proxy.apis.anthropic_messages import MessagesApi, MessagesRenderer, error_body, parse_request
from proxy.apis.reasoning import encode_reasoning
from proxy.engine import engine_body
from proxy.turns import EngineTurn
from proxy.errors import (
    BadRequest,
    CaptureFailed,
    ContextOverflow,
    EngineFailed,
    EngineTimeout,
    PayloadTooLarge,
    ProxyError,
    UnknownSession,
)
from proxy.apis.base import Route
from schemas.completions import Usage
from tests.proxy.conftest import ProxyUnderTest

pytestmark = pytest.mark.kafka

SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.330.572; cc_entrypoint=sdk-cli;"},
          {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "List the files.",
                                          "cache_control": {"type": "ephemeral"}}]}]
TOOLS = [{"name": "Bash", "description": "Run a command", "input_schema": {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
    "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
# The stand-in (like vLLM under guided decoding) replies with exactly this text; its hermes-style parser
# turns it into a tool call.
FORCED_CALL = r'<tool_call>\n\{"name": "Bash", "arguments": \{"command": "echo hi"\}\}\n</tool_call>'
CLAUDE_CODE_EXTRAS = {"thinking": {"type": "enabled", "budget_tokens": 31999, "display": "omitted"},
                      "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                      "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": SYSTEM, "messages": MESSAGES, **fields}


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) for each SSE frame; every frame must have both lines."""
    frames = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        frames.append((lines[0][7:], json.loads(lines[1][6:])))
    return frames


def assert_grammar(frames: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's event order: message_start; blocks started, filled and stopped one at a time with
    increasing indexes; message_delta after every block stopped; message_stop last."""
    names = [name for name, _ in frames]
    assert all(name == data["type"] for name, data in frames)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for name, data in frames[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None, "a content block was not stopped before message_delta"


def blocks_of(frames: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a client assembles from the stream (tool input parsed from its JSON pieces)."""
    blocks: list[dict[str, Any]] = []
    for name, data in frames:
        if name == "content_block_start":
            blocks.append({**data["content_block"], "_json": ""})
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            kind = delta["type"]
            if kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            elif kind == "input_json_delta":
                block["_json"] += delta["partial_json"]
    for block in blocks:
        raw = block.pop("_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(raw) if raw else {}
    return blocks


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    document = response.json()
    assert document["type"] == "error" and set(document["error"]) == {"type", "message"}
    assert document["error"]["type"] == kind and document["error"]["message"]
    assert "Traceback" not in document["error"]["message"]
    return document["error"]["message"]


def post(session: dict[str, Any], document: dict[str, Any] | bytes, **headers: str) -> httpx.Response:
    url = f"{session['base_urls']['anthropic']}/v1/messages?beta=true"
    headers = {"x-api-key": session["api_key"], **headers}
    if isinstance(document, bytes):
        return httpx.post(url, content=document, headers={"content-type": "application/json", **headers}, timeout=30)
    return httpx.post(url, json=document, headers=headers, timeout=30)


def prompt_ids_for(event: Any) -> list[int]:
    return tokenize(render_prompt(engine_body(event.request, "rollwire-tiny", stream=False)))


# -- through the proxy ---------------------------------------------------------------------------------

async def test_unknown_session_is_refused_in_anthropic_shape(proxy: ProxyUnderTest) -> None:
    document = body()
    by_path = httpx.post(f"{proxy.url}/s/no-such-session/v1/messages", json=document,
                         headers={"x-api-key": "some-key-123"})
    by_key = httpx.post(f"{proxy.url}/v1/messages", json=document, headers={"x-api-key": "nope-nope"})
    no_key = httpx.post(f"{proxy.url}/v1/messages", json=document)
    for response in (by_path, by_key, no_key):
        anthropic_error(response, 401, "authentication_error")
    assert "no-such-session" in by_path.json()["error"]["message"]


async def test_whole_reply_is_captured_token_for_token(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(session_id="msg-whole-1")
    response = post(session, body(max_tokens=8, temperature=0.5, top_p=0.9, top_k=20, **CLAUDE_CODE_EXTRAS))
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["type"] == "message" and reply["role"] == "assistant" and reply["id"].startswith("msg_")
    assert reply["model"] == "claude-sonnet-4-5"
    [block] = reply["content"]
    assert block["type"] == "text" and block["text"]
    assert reply["stop_reason"] == "max_tokens"  # the stand-in has more to say than 8 tokens
    [event] = await proxy.completions(1)
    assert event.session_id == "msg-whole-1" and event.api == "anthropic.messages" and event.status == "ok"
    assert event.requested_model == "claude-sonnet-4-5" and event.served_model == "rollwire-tiny"
    assert event.prompt_token_ids.tolist() == prompt_ids_for(event)
    assert event.token_ids.tolist() == list(block["text"].encode())
    assert reply["usage"]["input_tokens"] == len(event.prompt_token_ids)
    assert reply["usage"]["output_tokens"] == len(event.token_ids) == 8
    # the billing line is gone, the rest of the system prompt is there
    system = event.request.messages[0]
    assert system.role == "system" and system.content == "You are a coding agent."
    assert event.request.sampling.top_k == 20 and event.request.sampling.max_tokens == 8


async def test_stream_has_the_event_grammar_and_reassembles_to_the_recorded_tokens(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    document = body(stream=True, max_tokens=8, **CLAUDE_CODE_EXTRAS)
    with httpx.stream("POST", f"{proxy.url}/v1/messages?beta=true", json=document,
                      headers={"x-api-key": session["api_key"]}, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = events_of(response.read().decode())
    assert_grammar(frames)
    [block] = blocks_of(frames)
    start, delta = frames[0][1]["message"], frames[-2][1]
    [event] = await proxy.completions(1)
    assert block["type"] == "text" and block["text"] == event.message.content
    assert bytes(event.token_ids.tolist()).decode() == block["text"]
    assert start["usage"]["input_tokens"] == len(event.prompt_token_ids) == len(prompt_ids_for(event))
    assert start["model"] == "claude-sonnet-4-5" and start["content"] == []
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == len(event.token_ids)
    assert event.request.stream is True


async def test_billing_line_does_not_break_the_token_prefix(proxy: ProxyUnderTest) -> None:
    """Claude Code's billing line changes between calls; the second call still extends the first."""
    session = proxy.new_session()
    first = post(session, body(max_tokens=12)).json()
    second_system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.330.e10; cch=99;"},
                     SYSTEM[1]]
    history = MESSAGES + [{"role": "assistant", "content": first["content"]},
                          {"role": "user", "content": "Go on."}]
    assert post(session, body(max_tokens=12, system=second_system, messages=history)).status_code == 200
    earlier, later = await proxy.completions(2)
    head = earlier.prompt_token_ids.tolist() + earlier.token_ids.tolist()
    assert later.prompt_token_ids.tolist()[:len(head)] == head
    assert b"billing" not in bytes(later.prompt_token_ids.tolist())


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_use_round_trip(proxy: ProxyUnderTest, stream: bool) -> None:
    session = proxy.new_session(engine={"extra": {"structured_outputs": {"regex": FORCED_CALL}}, "seed": 3})
    response = post(session, body(tools=TOOLS, tool_choice={"type": "auto"}, stream=stream, max_tokens=200))
    assert response.status_code == 200, response.text
    if stream:
        frames = events_of(response.text)
        assert_grammar(frames)
        [block] = blocks_of(frames)
        stop_reason = frames[-2][1]["delta"]["stop_reason"]
        assert any(d["delta"]["type"] == "input_json_delta" for n, d in frames if n == "content_block_delta")
    else:
        reply = response.json()
        [block] = reply["content"]
        stop_reason = reply["stop_reason"]
    assert block["type"] == "tool_use" and block["name"] == "Bash" and block["input"] == {"command": "echo hi"}
    assert stop_reason == "tool_use"
    [event] = await proxy.completions(1)
    [call] = event.message.tool_calls
    assert event.finish_reason == "tool_calls" and call.id == block["id"]
    # The harness runs the tool and sends its result (blocks, marked as an error) with the call echoed.
    session_next = proxy.new_session(engine={"seed": 3})
    history = MESSAGES + [
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block["id"], "is_error": True,
             "content": [{"type": "text", "text": "bash: echo: failed"}]},
            {"type": "text", "text": "Try again."}]}]
    assert post(session_next, body(tools=TOOLS, messages=history, max_tokens=8)).status_code == 200
    [later] = [e for e in await proxy.completions(2) if e.session_id == session_next["session_id"]]
    roles = [m.role for m in later.request.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    tool = later.request.messages[3]
    assert tool.tool_call_id == call.id and tool.is_error is True and tool.content == "bash: echo: failed"
    assert later.request.messages[2].tool_calls[0].arguments == call.arguments  # the sampled layout is kept
    head = event.prompt_token_ids.tolist() + event.token_ids.tolist()
    assert later.prompt_token_ids.tolist()[:len(head)] == head


async def test_thinking_signature_restores_the_exact_reasoning(proxy: ProxyUnderTest) -> None:
    reasoning = "  The user wants files.\nI will list them.  "
    signature = encode_reasoning(reasoning)
    history = MESSAGES + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": signature},
                                          {"type": "text", "text": "Here they are."}]},
        {"role": "user", "content": "Thanks."}]
    session = proxy.new_session()
    assert post(session, body(messages=history, **CLAUDE_CODE_EXTRAS)).status_code == 200
    [event] = await proxy.completions(1)
    assistant = event.request.messages[2]
    assert assistant.reasoning == reasoning and assistant.content == "Here they are."
    assert f"<think>{reasoning}</think>Here they are.".encode() in bytes(event.prompt_token_ids.tolist())


async def test_engine_failures_are_shaped(proxy: ProxyUnderTest) -> None:
    overflow = proxy.new_session(engine={"extra": {"standin_fail": "overflow"}})
    message = anthropic_error(post(overflow, body()), 400, "invalid_request_error")
    assert message.startswith("prompt is too long")  # Claude Code compacts on this phrase
    broken = proxy.new_session(engine={"extra": {"standin_fail": "error"}})
    anthropic_error(post(broken, body(stream=True)), 502, "api_error")
    cut = proxy.new_session(engine={"extra": {"standin_fail": "cut"}})
    response = post(cut, body(stream=True, max_tokens=16))
    assert response.status_code == 200
    frames = events_of(response.text)
    assert frames[0][0] == "message_start" and frames[-1][0] == "error"
    assert frames[-1][1]["type"] == "error" and frames[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [name for name, _ in frames]


@pytest.mark.parametrize("content, fragment", [
    (b"{not json", "not valid JSON"),
    (b'[1, 2]', "JSON object"),
    (json.dumps({"model": "m", "max_tokens": 5}).encode(), "messages"),
    (json.dumps({"model": "m", "max_tokens": 5, "messages": []}).encode(), "messages"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(), "max_tokens"),
    (json.dumps({"max_tokens": 5, "messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
    (json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}
                ).encode(),
     "text only"),
    (json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]}).encode(), "text only"),
    (json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}).encode(),
     "hologram"),
    (json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                 "tool_choice": {"type": "tool"}}).encode(), "name"),
])
def test_bad_input_is_a_400_in_anthropic_shape(proxy: ProxyUnderTest, content: bytes, fragment: str) -> None:
    session = proxy.new_session()
    assert fragment in anthropic_error(post(session, content), 400, "invalid_request_error")


async def test_count_tokens_counts_what_a_call_would_send(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    document = body(tools=TOOLS, **CLAUDE_CODE_EXTRAS)
    counted = httpx.post(f"{session['base_urls']['anthropic']}/v1/messages/count_tokens?beta=true",
                         json={k: v for k, v in document.items() if k != "max_tokens"}, timeout=30,
                         headers={"x-api-key": session["api_key"]})
    assert counted.status_code == 200, counted.text
    assert post(session, document).status_code == 200
    [event] = await proxy.completions(1)
    assert counted.json() == {"input_tokens": len(event.prompt_token_ids)}
    refused = httpx.post(f"{proxy.url}/v1/messages/count_tokens", json=document, headers={"x-api-key": "nope"})
    anthropic_error(refused, 401, "authentication_error")
    bad = httpx.post(f"{session['base_urls']['anthropic']}/v1/messages/count_tokens", json={"messages": []},
                     headers={"x-api-key": session["api_key"]})
    anthropic_error(bad, 400, "invalid_request_error")


def test_head_preflight_answers(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    assert httpx.head(f"{proxy.url}/").status_code == 200
    assert httpx.head(session["base_urls"]["anthropic"]).status_code == 200


# -- the normalizer and renderer on their own ----------------------------------------------------------

def test_normalizes_claude_code_conversation_shapes() -> None:
    document = body(
        system="Plain system prompt.",
        tools=TOOLS + [{"name": "Later", "description": "d", "input_schema": {"type": "object"}, "defer_loading": True},
                       {"name": "Found", "description": "d", "input_schema": {"type": "object"}, "defer_loading": True},
                       {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        tool_choice={"type": "any"}, stop_sequences=["END"], output_config={"effort": "max"},
        thinking={"type": "disabled"},
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "echoed text", "signature": "EqQBCkgIARABGAIiQ"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "select:Found"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "tool_reference", "tool_name": "Found"}]},
                {"type": "text", "text": "<system-reminder>r</system-reminder>"}]},
            {"role": "system", "content": [{"type": "text", "text": "Mid-conversation system note."}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0"}]},
        ])
    request = MessagesApi().parse(document, Route(query={"beta": "true"})).request
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool", "user", "system", "tool"]
    assistant = request.messages[2]
    assert assistant.reasoning == "echoed text"  # a foreign signature: the echoed text is all there is
    assert assistant.content == "Looking." and assistant.tool_calls[0].arguments == '{"query": "select:Found"}'
    assert request.messages[3].content == "<tool_reference>Found</tool_reference>"
    assert request.messages[5].content == "Mid-conversation system note."
    assert request.messages[6].content == "" and request.messages[6].tool_call_id == "toolu_0"
    assert [t.name for t in request.tools] == ["Bash", "Found"]  # deferred and server tools left out
    assert request.tools[0].parameters == TOOLS[0]["input_schema"]
    assert request.tool_choice == "required" and request.sampling.stop == ["END"]
    assert request.reasoning_effort == "high" and request.chat_template_kwargs == {"enable_thinking": False}
    named = MessagesApi().parse(body(tool_choice={"type": "tool", "name": "Bash"}), Route()).request
    assert named.tool_choice == {"type": "function", "function": {"name": "Bash"}}
    assert MessagesApi().parse(body(tool_choice={"type": "none"}), Route()).request.tool_choice == "none"


def _turn(**fields: Any) -> EngineTurn:
    values = dict(prompt_token_ids=[1, 2, 3], token_ids=[4, 5], logprobs=[-0.1, -0.2], content=None, reasoning=None,
                  tool_calls=[], finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=2))
    return EngineTurn(**{**values, **fields})


@pytest.mark.parametrize("display", [None, "omitted"])
def test_thinking_is_rendered_with_a_signature_that_round_trips(display: str | None) -> None:
    reasoning, thinking = "Step one.\n\nStep two. ", {"type": "enabled", "budget_tokens": 1024}
    if display:
        thinking["display"] = display
    wire = parse_request(body(thinking=thinking), need_max_tokens=True)
    turn = _turn(reasoning=reasoning, content="Done.")
    whole = MessagesRenderer(wire).response(turn)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    renderer = MessagesRenderer(wire)
    frames = events_of(b"".join(renderer.stream_whole(turn)).decode())
    assert_grammar(frames)
    streamed = blocks_of(frames)
    thinking_frames = [d["delta"]["type"] for n, d in frames if n == "content_block_delta" and d["index"] == 0]
    assert thinking_frames[-1] == "signature_delta"
    for blocks in (whole["content"], streamed):
        block = blocks[0]
        assert block["thinking"] == ("" if display else reasoning)
        echoed = body(messages=MESSAGES + [{"role": "assistant", "content": blocks}, {"role": "user", "content": "ok"}])
        assert MessagesApi().parse(echoed, Route()).request.messages[2].reasoning == reasoning


def test_tool_calls_stream_as_blocks_in_order() -> None:
    from proxy.turns import EngineDelta, ToolCallDelta

    renderer = MessagesRenderer(parse_request(body(stream=True), need_max_tokens=True))
    chunks = renderer.stream_delta(EngineDelta(prompt_token_ids=[1, 2]))
    chunks += renderer.stream_delta(EngineDelta(content="Running two."))
    for index, (name, arguments) in enumerate([("Bash", '{"command": "ls"}'), ("Read", '{"file_path": "/a"}')]):
        chunks += renderer.stream_delta(EngineDelta(tool_calls=[ToolCallDelta(index, f"c{index}", name, "")]))
        chunks += renderer.stream_delta(EngineDelta(tool_calls=[ToolCallDelta(index, None, None, arguments[:5])]))
        chunks += renderer.stream_delta(EngineDelta(tool_calls=[ToolCallDelta(index, None, None, arguments[5:])]))
    held = len(chunks)
    chunks += renderer.stream_finish(_turn(finish_reason="tool_calls"))
    frames = events_of(b"".join(chunks).decode())
    assert_grammar(frames)
    assert [b["type"] for b in blocks_of(frames)] == ["text", "tool_use", "tool_use"]
    assert blocks_of(frames)[2]["input"] == {"file_path": "/a"}
    # the last block's stop waits for the closing part (sent after the call is recorded)
    closing = [name for name, _ in events_of(b"".join(chunks[held:]).decode())]
    assert closing == ["content_block_stop", "message_delta", "message_stop"]
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(("fields", "reason", "sequence"), [
    ({"stop_reason": "END"}, "stop_sequence", "END"),  # vLLM names the stop string it stopped on
    ({"stop_reason": None}, "end_turn", None),  # the tokenizer's end of sequence
    ({"stop_reason": 151643}, "end_turn", None),  # another end id: a token, not a stop sequence
    ({"stop_reason": "END", "finish_reason": "length"}, "max_tokens", None),
    ({"stop_reason": "END", "finish_reason": "tool_calls"}, "tool_use", None),
])
def test_a_stop_string_is_the_stop_sequence_whole_and_streamed(fields: dict[str, Any], reason: str,
                                                                sequence: str | None) -> None:
    turn = _turn(content="done. ", **fields)
    whole = MessagesRenderer(parse_request(body(stop_sequences=["END"]), need_max_tokens=True)).response(turn)
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, sequence)
    renderer = MessagesRenderer(parse_request(body(stop_sequences=["END"], stream=True), need_max_tokens=True))
    frames = events_of(b"".join(renderer.stream_whole(turn)).decode())
    assert_grammar(frames)
    [delta] = [data["delta"] for name, data in frames if name == "message_delta"]
    assert (delta["stop_reason"], delta["stop_sequence"]) == (reason, sequence)


@pytest.mark.parametrize("error, status, kind", [
    (BadRequest("x"), 400, "invalid_request_error"),
    (UnknownSession("x"), 401, "authentication_error"),
    (PayloadTooLarge("x"), 413, "request_too_large"),
    (EngineFailed("x"), 502, "api_error"),
    (CaptureFailed("x"), 503, "overloaded_error"),
    (EngineTimeout("x"), 504, "timeout_error"),
    (ContextOverflow("x"), 400, "invalid_request_error"),
    (ProxyError("x"), 500, "api_error"),
])
def test_error_types(error: ProxyError, status: int, kind: str) -> None:
    assert error.status_code == status
    assert error_body(error)["error"]["type"] == kind
