"""The Gemini API through the proxy against the stand-in engine, with capture on real Kafka, and the
normalizer's Gemini-specific choices (derived call ids, thought signatures, OpenAPI schemas) on their own."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.standin_engine import render_prompt, tokenize
from proxy.engine import engine_body
from proxy.turns import EngineTurn
from proxy import errors
from proxy.turns import EngineDelta
from proxy.errors import BadRequest
from proxy.apis.gemini import GeminiApi, GeminiRenderer, error_body, json_schema
from proxy.apis.reasoning import decode_reasoning, encode_reasoning
from proxy.apis.base import Route
from schemas.completions import ToolCall, Usage
from tests.proxy.conftest import ProxyUnderTest

SYSTEM = {"parts": [{"text": "You are a coding agent."}]}
USER = {"role": "user", "parts": [{"text": "List the files."}]}
SHELL = {"name": "shell", "description": "Run a command",
         "parameters": {"type": "OBJECT", "properties": {"command": {"type": "STRING"}}, "required": ["command"]}}
FORCED_CALL = r'<tool_call>\n\{"name": "shell", "arguments": \{"command": "echo hi"\}\}\n</tool_call>'
MODEL = "gemini-2.5-flash"


def gemini_url(session: dict, method: str = "generateContent") -> str:
    return f"{session['base_urls']['gemini']}/v1beta/models/{MODEL}:{method}"


def sse_documents(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def turn(**fields: object) -> EngineTurn:
    values: dict = dict(prompt_token_ids=[1], token_ids=[2], logprobs=[-0.5], content=None, reasoning=None,
                        tool_calls=[], finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1))
    values.update(fields)
    return EngineTurn(**values)


# -- the normalizer on its own -----------------------------------------------------------------------

def test_openapi_schema_becomes_json_schema() -> None:
    converted = json_schema({"type": "OBJECT", "propertyOrdering": ["a", "b"], "properties": {
        "a": {"type": "ARRAY", "items": {"type": "INTEGER", "format": "int32"}, "description": "ids"},
        "b": {"type": "STRING", "nullable": True, "enum": ["x", "y"]},
        "c": {"anyOf": [{"type": "NUMBER"}, {"type": "BOOLEAN"}]}}, "required": ["a"]})
    assert converted == {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer", "format": "int32"}, "description": "ids"},
        "b": {"type": ["string", "null"], "enum": ["x", "y"]},
        "c": {"anyOf": [{"type": "number"}, {"type": "boolean"}]}}, "required": ["a"]}


def test_parameters_json_schema_is_taken_as_is_and_parameters_converted() -> None:
    raw = {"type": "object", "properties": {"path": {"type": "string", "const": "a"}}, "additionalProperties": False}
    declarations = [SHELL, {"name": "read", "parametersJsonSchema": raw}]
    body = {"contents": [USER], "tools": [{"functionDeclarations": declarations}, {"googleSearch": {}}]}
    request = GeminiApi().parse(body, Route(model=MODEL, stream=False)).request
    shell, read = request.tools
    assert shell.parameters == {"type": "object", "properties": {"command": {"type": "string"}},
                                "required": ["command"]}
    assert read.parameters == raw  # hosted googleSearch is dropped, not an error


def test_thought_signature_stands_for_the_reasoning() -> None:
    reasoning = "The user wants files listed. Ünïcode too: 日本."
    signature = encode_reasoning(reasoning)
    assert len(signature) % 4 == 0 and signature.isascii()  # Pi keeps only valid standard base64
    assert decode_reasoning(signature, param="thoughtSignature") == reasoning
    assert decode_reasoning("c29tZSByZWFsIGdlbWluaSBzaWduYXR1cmU=", param="s") is None  # someone else's: ignored
    assert decode_reasoning("not base64!", param="s") is None


@pytest.mark.parametrize("include_thoughts", [False, True])
def test_reply_with_reasoning_round_trips_through_its_signature(include_thoughts: bool) -> None:
    """What we hand out for a turn with reasoning, sent back as history, normalizes to that reasoning."""
    body = {"contents": [USER], "tools": [{"functionDeclarations": [SHELL]}],
            "generationConfig": {"thinkingConfig": {"includeThoughts": include_thoughts}}}
    api = GeminiApi()
    renderer = api.parse(body, Route(model=MODEL, stream=False)).renderer
    engine_turn = turn(reasoning="I should run ls.", content="Running it.", finish_reason="tool_calls",
                       tool_calls=[ToolCall(id="chatcmpl-tool-1", name="shell", arguments='{"command": "ls"}')])
    reply = renderer.response(engine_turn)
    parts = reply["candidates"][0]["content"]["parts"]
    assert [("thought" in p, "text" in p, "functionCall" in p) for p in parts] == (
        [(True, True, False)] if include_thoughts else []) + [(False, True, False), (False, False, True)]
    assert parts[-1]["functionCall"]["args"] == {"command": "ls"}
    assert reply["candidates"][0]["finishReason"] == "STOP"
    # Pi's replay: thoughts only as thought parts (or dropped), signatures where they were.
    result = {"functionResponse": {"name": "shell", "response": {"output": "a.txt"}}}
    history = {**body, "contents": [USER, {"role": "model", "parts": parts}, {"role": "user", "parts": [result]}]}
    messages = api.parse(history, Route(model=MODEL, stream=False)).request.messages
    assistant, tool = messages[1], messages[2]
    assert assistant.reasoning == "I should run ls." and assistant.content == "Running it."
    assert tool.role == "tool" and tool.content == "a.txt" and tool.tool_call_id == assistant.tool_calls[0].id
    assert parts[-1]["functionCall"]["id"] == assistant.tool_calls[0].id  # the id we gave is the one derived


def test_call_ids_are_stable_and_pair_by_name_or_id() -> None:
    """Gemini calls without ids: the same history gives the same ids on every turn, identical calls get
    distinct ids, and each functionResponse answers the call it belongs to."""
    ls = {"functionCall": {"name": "shell", "args": {"command": "ls"}}}
    read = {"functionCall": {"name": "read", "args": {"path": "a"}}}
    contents = [USER, {"role": "model", "parts": [ls, read]},
                {"role": "user", "parts": [{"functionResponse": {"name": "read", "response": {"output": "A"}}},
                                           {"functionResponse": {"name": "shell", "response": {"error": "boom"}}}]},
                {"role": "model", "parts": [ls]},
                {"role": "user", "parts": [{"functionResponse": {"name": "shell", "response": {"x": 1}}},
                                           {"text": "and now?"}]}]
    api = GeminiApi()
    first = api.parse({"contents": contents[:3]}, Route(model=MODEL)).request.messages
    later = api.parse({"contents": contents}, Route(model=MODEL)).request.messages
    assert [m.model_dump() for m in later[:4]] == [m.model_dump() for m in first]
    call_ls, call_read = later[1].tool_calls
    assert later[2].tool_call_id == call_read.id and later[2].content == "A"
    assert later[3].tool_call_id == call_ls.id and later[3].is_error and later[3].content == "boom"
    [again] = later[4].tool_calls
    assert again.id != call_ls.id and again.arguments == call_ls.arguments
    assert later[5].tool_call_id == again.id and json.loads(later[5].content) == {"x": 1}
    assert [m.role for m in later] == ["user", "assistant", "tool", "tool", "assistant", "tool", "user"]


def test_given_ids_win_over_derived_ones() -> None:
    contents = [USER, {"role": "model", "parts": [{"functionCall": {"name": "shell", "args": {}, "id": "c1"}},
                                                  {"functionCall": {"name": "shell", "args": {}, "id": "c2"}}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "shell", "id": "c2", "response": {}}},
                                           {"functionResponse": {"name": "shell", "id": "c1", "response": {}}}]}]
    messages = GeminiApi().parse({"contents": contents}, Route(model=MODEL)).request.messages
    assert [m.tool_call_id for m in messages[2:]] == ["c2", "c1"]


def test_generation_config_and_tool_config_map_to_the_internal_form() -> None:
    body = {"contents": [{"parts": [{"text": "hi"}]}], "systemInstruction": SYSTEM,
            "tools": [{"functionDeclarations": [SHELL]}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["shell"]}},
            "generationConfig": {"temperature": 0.3, "topP": 0.9, "topK": 20, "maxOutputTokens": 77, "seed": 5,
                                 "stopSequences": ["END"], "candidateCount": 1,
                                 "thinkingConfig": {"thinkingBudget": 0}},
            "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
            "cachedContent": "cachedContents/abc"}
    parsed = GeminiApi().parse(body, Route(model="models/gemini-x", stream=True, query={"alt": "sse"}))
    request = parsed.request
    assert parsed.requested_model == "gemini-x" and parsed.stream
    assert [(m.role, m.content if isinstance(m.content, str) else m.content[0].text) for m in request.messages] == [
        ("system", "You are a coding agent."), ("user", "hi")]
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed, s.stop) == (0.3, 0.9, 20, 77, 5, ["END"])
    assert request.tool_choice == {"type": "function", "function": {"name": "shell"}}
    assert request.chat_template_kwargs == {"enable_thinking": False}
    for mode, choice in (("AUTO", "auto"), ("NONE", "none"), ("ANY", "required")):
        body["toolConfig"] = {"functionCallingConfig": {"mode": mode}}
        assert GeminiApi().parse(body, Route(model=MODEL)).request.tool_choice == choice


def test_snake_case_fields_mean_what_their_camel_case_spelling_means() -> None:
    # Gemini's REST API takes both spellings, and google-genai (Python) sends snake_case for some fields:
    # parameters_json_schema, include_thoughts, mime_type. None may be dropped silently.
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "additionalProperties": False}
    camel = {"contents": [{"role": "user", "parts": [{"text": "hi"},
                                                     {"inlineData": {"mimeType": "image/png", "data": "aGk="}}]}],
             "systemInstruction": SYSTEM,
             "tools": [{"functionDeclarations": [SHELL, {"name": "read", "parametersJsonSchema": schema}]}],
             "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["read"]}},
             "generationConfig": {"topP": 0.9, "topK": 20, "maxOutputTokens": 77, "stopSequences": ["END"],
                                  "thinkingConfig": {"includeThoughts": True, "thinkingBudget": 0}}}
    snake = {"contents": [{"role": "user", "parts": [{"text": "hi"},
                                                     {"inline_data": {"mime_type": "image/png", "data": "aGk="}}]}],
             "system_instruction": SYSTEM,
             "tools": [{"function_declarations": [SHELL, {"name": "read", "parameters_json_schema": schema}]}],
             "tool_config": {"function_calling_config": {"mode": "ANY", "allowed_function_names": ["read"]}},
             "generation_config": {"top_p": 0.9, "top_k": 20, "max_output_tokens": 77, "stop_sequences": ["END"],
                                   "thinking_config": {"include_thoughts": True, "thinking_budget": 0}},
             "safety_settings": []}
    from_camel = GeminiApi().parse(camel, Route(model=MODEL)).request
    from_snake = GeminiApi().parse(snake, Route(model=MODEL)).request
    assert from_snake == from_camel
    assert [t.parameters for t in from_snake.tools][1] == schema
    assert from_snake.sampling.max_tokens == 77 and from_snake.messages[0].role == "system"
    assert from_snake.tool_choice == {"type": "function", "function": {"name": "read"}}
    # An error's path follows the spelling sent; a missing field is named as the API documents it.
    with pytest.raises(BadRequest) as missing:
        GeminiApi().parse({"contents": [{"parts": [{"inline_data": {"data": "x"}}]}]}, Route(model=MODEL))
    assert "contents.0.parts.0.inline_data.mimeType: Field required" in str(missing.value)


@pytest.mark.parametrize("body, param, fragment", [
    ({"contents": []}, "contents", "at least 1"),
    ({"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]}, "contents.0.role", "'user'"),
    ({"contents": [USER], "generationConfig": {"candidateCount": 2}}, "generationConfig.candidateCount",
     "candidateCount"),
    ({"contents": [{"role": "user", "parts": []}]}, "contents.0.parts", "at least 1"),
    ({"contents": [{"role": "user", "parts": [{"executableCode": {"code": "1"}}]}]}, "contents.0.parts.0",
     "unsupported"),
    ({"contents": [USER], "tools": [{"functionDeclarations": [{"name": "f", "parameters": {"type": "STRING"}}]}]},
     "tools.0.functionDeclarations.0.parameters", "object"),
])
def test_bad_bodies_name_the_field(body: dict, param: str, fragment: str) -> None:
    with pytest.raises(BadRequest) as caught:
        GeminiApi().parse(body, Route(model=MODEL, stream=False))
    assert caught.value.param == param and fragment in caught.value.message
    error = error_body(caught.value)["error"]
    assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
    assert error["details"][0]["fieldViolations"][0]["field"] == param


@pytest.mark.parametrize("error, status", [
    (errors.BadRequest("x"), "INVALID_ARGUMENT"), (errors.ContextOverflow("x"), "INVALID_ARGUMENT"),
    (errors.PayloadTooLarge("x"), "INVALID_ARGUMENT"), (errors.UnknownSession("x"), "UNAUTHENTICATED"),
    (errors.NotFound("x"), "NOT_FOUND"), (errors.EngineUnavailable("x"), "UNAVAILABLE"),
    (errors.CaptureFailed("x"), "UNAVAILABLE"), (errors.EngineTimeout("x"), "DEADLINE_EXCEEDED"),
    (errors.EngineFailed("x"), "INTERNAL"), (errors.ProxyError("x"), "INTERNAL"),
])
def test_error_statuses_are_googles(error: errors.ProxyError, status: str) -> None:
    assert error_body(error) == {"error": {"code": error.status_code, "message": "x", "status": status}}


def test_stream_without_alt_sse_is_one_json_array() -> None:
    renderer = GeminiApi().parse({"contents": [USER]}, Route(model=MODEL, stream=True)).renderer
    assert isinstance(renderer, GeminiRenderer) and not renderer.sse
    chunks = renderer.stream_delta(EngineDelta(content="he")) + renderer.stream_delta(EngineDelta(content="llo"))
    documents = json.loads(b"".join(chunks + renderer.stream_finish(turn(content="hello"))))
    assert "".join(p["text"] for d in documents for p in d["candidates"][0]["content"]["parts"]) == "hello"
    assert documents[-1]["candidates"][0]["finishReason"] == "STOP" and "usageMetadata" in documents[-1]


# -- through the proxy, on real Kafka -------------------------------------------------------------------

@pytest.mark.kafka
async def test_whole_reply_is_captured_token_for_token(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session(session_id="gemini-whole")
    response = httpx.post(gemini_url(session), timeout=30, headers={"x-goog-api-key": session["api_key"]}, json={
        "contents": [USER], "systemInstruction": SYSTEM, "generationConfig": {"maxOutputTokens": 8}})
    assert response.status_code == 200, response.text
    reply = response.json()
    [candidate] = reply["candidates"]
    text = candidate["content"]["parts"][0]["text"]
    assert candidate["content"]["role"] == "model" and candidate["finishReason"] in ("STOP", "MAX_TOKENS")
    assert reply["modelVersion"] == MODEL and reply["responseId"]
    [event] = await proxy.completions(1)
    assert event.session_id == "gemini-whole" and event.api == "gemini" and event.requested_model == MODEL
    sent = engine_body(event.request, "rollwire-tiny", stream=False)
    assert event.prompt_token_ids.tolist() == tokenize(render_prompt(sent))
    assert event.token_ids.tolist() == list(text.encode())
    usage = reply["usageMetadata"]
    assert usage["promptTokenCount"] == len(event.prompt_token_ids)
    assert usage["candidatesTokenCount"] == len(event.token_ids) == event.usage.completion_tokens
    assert usage["totalTokenCount"] == usage["promptTokenCount"] + usage["candidatesTokenCount"]
    assert [m.role for m in event.request.messages] == ["system", "user"]


@pytest.mark.kafka
async def test_sse_stream_reassembles_to_the_recorded_tokens(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    with httpx.stream("POST", gemini_url(session, "streamGenerateContent") + "?alt=sse", timeout=30, headers={"x-goog-api-key": session["api_key"]},
                      json={"contents": [USER]}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        documents = sse_documents(response.read().decode())
    assert len(documents) > 2
    text = "".join(p["text"] for d in documents for p in d["candidates"][0]["content"]["parts"])
    *body, last = documents
    assert all("finishReason" not in d["candidates"][0] and "usageMetadata" not in d for d in body)
    assert last["candidates"][0]["finishReason"] in ("STOP", "MAX_TOKENS")
    assert {d["responseId"] for d in documents} == {last["responseId"]} and last["modelVersion"] == MODEL
    [event] = await proxy.completions(1)
    assert event.request.stream and bytes(event.token_ids.tolist()).decode() == text == event.message.content
    assert last["usageMetadata"]["candidatesTokenCount"] == len(event.token_ids)


@pytest.mark.kafka
async def test_stream_without_alt_sse_is_a_json_array(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    response = httpx.post(gemini_url(session, "streamGenerateContent"), json={"contents": [USER]}, timeout=30, headers={"x-goog-api-key": session["api_key"]})
    assert response.status_code == 200, response.text
    documents = json.loads(response.content)
    assert documents[-1]["candidates"][0]["finishReason"] and documents[-1]["usageMetadata"]["totalTokenCount"]
    [event] = await proxy.completions(1)
    text = "".join(p["text"] for d in documents for p in d["candidates"][0]["content"]["parts"])
    assert event.message.content == text


@pytest.mark.kafka
async def test_api_key_addresses_the_session(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    url = f"{proxy.url}/v1beta/models/{MODEL}:generateContent"
    by_header = httpx.post(url, json={"contents": [USER]}, headers={"x-goog-api-key": session["api_key"]},
                           timeout=30)
    by_query = httpx.post(url, params={"key": session["api_key"]}, json={"contents": [USER]}, timeout=30)
    assert by_header.status_code == 200 and by_query.status_code == 200, by_header.text + by_query.text
    events = await proxy.completions(2)
    assert [(e.session_id, e.sequence) for e in events] == [(session["session_id"], 0), (session["session_id"], 1)]


@pytest.mark.kafka
@pytest.mark.parametrize("stream", [False, True])
async def test_forced_function_call_round_trip(proxy: ProxyUnderTest, stream: bool) -> None:
    """Turn 0 is forced to a functionCall, turn 1 (after the functionResponse) to text; the reply's call
    comes whole, the response pairs with it, and the second prompt extends the first."""
    session = proxy.new_session(engine={"seed": 3, "turns": [{"structured_outputs": {"regex": FORCED_CALL}},
                                                             {"structured_outputs": {"regex": "All done\\."}}]})
    method = "streamGenerateContent" if stream else "generateContent"
    url = gemini_url(session, method) + ("?alt=sse" if stream else "")
    body = {"contents": [USER], "systemInstruction": SYSTEM, "tools": [{"functionDeclarations": [SHELL]}],
            "generationConfig": {"temperature": 0.7, "maxOutputTokens": 200}}
    first = httpx.post(url, json=body, timeout=30, headers={"x-goog-api-key": session["api_key"]})
    assert first.status_code == 200, first.text
    documents = sse_documents(first.text) if stream else [first.json()]
    calls = [p for d in documents for p in d["candidates"][0]["content"]["parts"] if "functionCall" in p]
    [call] = calls
    assert call["functionCall"]["name"] == "shell" and call["functionCall"]["args"] == {"command": "echo hi"}
    last = documents[-1]["candidates"][0]
    assert last["finishReason"] == "STOP" and call in last["content"]["parts"]  # whole, in the closing chunk
    # Pi's way back: the call without its id, the result as {"output": ...}.
    echoed = {"functionCall": {"name": "shell", "args": call["functionCall"]["args"]}}
    body["contents"] = [USER, {"role": "model", "parts": [echoed]},
                        {"role": "user", "parts": [{"functionResponse": {"name": "shell",
                                                                         "response": {"output": "hi\n"}}}]}]
    second = httpx.post(url, json=body, timeout=30, headers={"x-goog-api-key": session["api_key"]})
    assert second.status_code == 200, second.text
    documents = sse_documents(second.text) if stream else [second.json()]
    assert "".join(p.get("text", "") for d in documents for p in d["candidates"][0]["content"]["parts"]) == "All done."
    one, two = await proxy.completions(2)
    assert one.finish_reason == "tool_calls" and [c.name for c in one.message.tool_calls] == ["shell"]
    assistant, result = two.request.messages[2:]
    assert assistant.tool_calls[0].id == call["functionCall"]["id"] == result.tool_call_id
    assert result.content == "hi\n" and two.message.content == "All done."
    assert two.prompt_token_ids.tolist()[:len(one.prompt_token_ids)] == one.prompt_token_ids.tolist()
    assert one.request.sampling.temperature == 0.7 and one.request.sampling.seed == 3
    assert one.request.tools[0].parameters["properties"]["command"] == {"type": "string"}


@pytest.mark.kafka
async def test_returned_signature_restores_the_reasoning(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    signed = {"text": "I will look.", "thoughtSignature": encode_reasoning("hmm")}
    contents = [USER, {"role": "model", "parts": [signed]},
                {"role": "user", "parts": [{"text": "go on"}]}]
    response = httpx.post(gemini_url(session), json={"contents": contents}, timeout=30, headers={"x-goog-api-key": session["api_key"]})
    assert response.status_code == 200, response.text
    [event] = await proxy.completions(1)
    assert event.request.messages[1].reasoning == "hmm" and event.request.messages[1].content == "I will look."
    assert "<think>hmm</think>I will look." in bytes(event.prompt_token_ids.tolist()).decode()


@pytest.mark.kafka
@pytest.mark.parametrize("path, body, status, google_status", [
    ("generateContent", {"contents": []}, 400, "INVALID_ARGUMENT"),
    ("generateContent", {"contents": [{"role": "bot", "parts": [{"text": "x"}]}]}, 400, "INVALID_ARGUMENT"),
    ("generateContent", {"contents": [USER], "generationConfig": {"candidateCount": 2}}, 400, "INVALID_ARGUMENT"),
    ("generateContent", [USER], 400, "INVALID_ARGUMENT"),
    ("countTokens", {"contents": []}, 400, "INVALID_ARGUMENT"),
    ("embedContent", {"contents": [USER]}, 404, "NOT_FOUND"),
])
async def test_bad_requests_get_gemini_shaped_errors(proxy: ProxyUnderTest, path: str, body: object, status: int,
                                                     google_status: str) -> None:
    session = proxy.new_session()
    response = httpx.post(f"{session['base_urls']['gemini']}/v1beta/models/{MODEL}:{path}", json=body, timeout=30, headers={"x-goog-api-key": session["api_key"]})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["status"] == google_status and error["message"]
    assert "Traceback" not in error["message"]


@pytest.mark.kafka
async def test_unknown_session_is_unauthenticated(proxy: ProxyUnderTest) -> None:
    by_path = httpx.post(f"{proxy.url}/s/nobody/v1beta/models/{MODEL}:generateContent", json={"contents": [USER]},
                         headers={"x-goog-api-key": "some-key-123"})
    by_key = httpx.post(f"{proxy.url}/v1beta/models/{MODEL}:streamGenerateContent?alt=sse",
                        json={"contents": [USER]}, headers={"x-goog-api-key": "wrong"})
    for response in (by_path, by_key):
        assert response.status_code == 401, response.text
        assert response.json()["error"]["status"] == "UNAUTHENTICATED"
    no_key = httpx.post(f"{proxy.url}/v1beta/models/{MODEL}:generateContent", content=b"hi",
                        headers={"content-type": "text/plain"})
    assert no_key.status_code == 401  # the key is checked before the body
    session = proxy.new_session()
    text_body = httpx.post(f"{proxy.url}/v1beta/models/{MODEL}:generateContent", content=b"hi",
                           headers={"content-type": "text/plain", "x-goog-api-key": session["api_key"]})
    assert text_body.status_code == 415 and text_body.json()["error"]["status"] == "INVALID_ARGUMENT"
