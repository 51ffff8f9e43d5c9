"""Regression tests for the faults an outside fuzzing campaign found in the Anthropic, Gemini and Responses
modules: each is a 400 in the provider's own shape now (or, for Gemini's schemas, a correct request),
never a 500. Each fault is checked on ``parse`` in-process, and the main ones through the real HTTP app.
A property test at the end fuzzes ``parse`` with the recorded harness bodies as seeds."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from proxy.apis.anthropic_messages import MessagesApi, MessagesRenderer, parse_request as parse_messages
from proxy.turns import EngineTurn
from proxy.errors import BadRequest, ProxyError
from proxy.apis.gemini import GeminiApi, json_schema
from proxy.apis.openai_responses import ResponsesApi, custom_input
from proxy.apis.base import Route
from proxy.apis.reasoning import CHECKSUM_BYTES, FORMAT_VERSION, ITEM_LIMIT, MAGIC, REQUEST_LIMIT, encode_reasoning
from schemas.completions import ToolCall, Usage
from tests.proxy.conftest import ProxyUnderTest

HARNESSES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses"
GEMINI_ROUTE = Route(model="models/gemini-2.5-flash", stream=False)


# -- helpers -------------------------------------------------------------------------------------------

def bomb_value(size: int = 100 << 20) -> str:
    """A reasoning value of ours (valid header and checksum) whose text is ``size`` zero bytes."""
    text = bytes(size)
    squeezer = zlib.compressobj(9)
    compressed = b"".join(squeezer.compress(text[i:i + (1 << 20)]) for i in range(0, size, 1 << 20))
    compressed += squeezer.flush()
    digest = hashlib.sha256(text).digest()[:CHECKSUM_BYTES]
    return base64.b64encode(MAGIC + bytes([FORMAT_VERSION]) + digest + compressed).decode("ascii")


def not_utf8_value() -> str:
    data = b"\xff\xfe\xfd"
    digest = hashlib.sha256(data).digest()[:CHECKSUM_BYTES]
    return base64.b64encode(MAGIC + bytes([FORMAT_VERSION]) + digest + zlib.compress(data)).decode("ascii")


def anthropic_body(assistant: list[Any] | None = None, user: list[Any] | None = None, **fields: Any) -> dict:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    if assistant is not None:
        messages += [{"role": "assistant", "content": assistant}, {"role": "user", "content": "Go on."}]
    if user is not None:
        messages.append({"role": "user", "content": user})
    return {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": messages, **fields}


def thinking(signature: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": "", "signature": signature}


def gemini_body(model_parts: list[dict[str, Any]] | None = None, **fields: Any) -> dict:
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "List the files."}]}]
    if model_parts is not None:
        contents += [{"role": "model", "parts": model_parts}, {"role": "user", "parts": [{"text": "Go on."}]}]
    return {"contents": contents, **fields}


def responses_body(*items: dict[str, Any], **fields: Any) -> dict:
    return {"model": "gpt-5-codex", "input": [{"type": "message", "role": "user",
                                               "content": [{"type": "input_text", "text": "List the files."}]},
                                              *items], **fields}


def refused(api: Any, document: Any, param: str, route: Route = Route()) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        api.parse(document, route)
    assert caught.value.status_code == 400 and caught.value.param == param, caught.value.message
    return caught.value


def anthropic_post(session: dict, document: Any) -> httpx.Response:
    return httpx.post(f"{session['base_urls']['anthropic']}/v1/messages", json=document, timeout=30,
                      headers={"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"})


def gemini_post(session: dict, document: Any) -> httpx.Response:
    return httpx.post(f"{session['base_urls']['gemini']}/v1beta/models/gemini-2.5-flash:generateContent",
                      json=document, timeout=30, headers={"x-goog-api-key": session["api_key"]})


def responses_post(session: dict, document: Any) -> httpx.Response:
    return httpx.post(f"{session['base_urls']['openai']}/responses", json=document, timeout=30,
                      headers={"Authorization": f"Bearer {session['api_key']}"})


def anthropic_400(response: httpx.Response, fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert fragment in error["error"]["message"], error


def gemini_400(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["status"] == "INVALID_ARGUMENT", error
    assert error["details"][0]["fieldViolations"][0]["field"] == field, error


def responses_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


# -- fault 2: unbounded decompression of reasoning values -------------------------------------------------

def test_fault2_unbounded_decompression_anthropic_signature_is_refused() -> None:
    body = anthropic_body(assistant=[thinking(bomb_value()), {"type": "text", "text": "Here."}])
    started = time.perf_counter()
    error = refused(MessagesApi(), body, "messages.1.content.0.signature")
    assert time.perf_counter() - started < 1.0 and str(ITEM_LIMIT) in error.message


def test_fault2_unbounded_decompression_gemini_signature_is_refused() -> None:
    body = gemini_body([{"text": "Here.", "thoughtSignature": bomb_value()}])
    refused(GeminiApi(), body, "contents.1.parts.0.thoughtSignature", GEMINI_ROUTE)


def test_fault2_unbounded_decompression_responses_encrypted_content_is_refused() -> None:
    body = responses_body({"type": "reasoning", "summary": [], "encrypted_content": bomb_value()})
    refused(ResponsesApi(), body, "input.1.encrypted_content")


def test_fault2_many_small_bombs_in_one_body_are_held_to_the_request_budget() -> None:
    """A 272 KB body of signatures each just under the per-item limit must not add up past the budget."""
    one = bomb_value(ITEM_LIMIT - 1024)
    count = 272_000 // len(one)
    assert count * (ITEM_LIMIT - 1024) > 4 * REQUEST_LIMIT
    body = anthropic_body(assistant=[thinking(one) for _ in range(count)])
    assert len(json.dumps(body)) < 300_000
    started = time.perf_counter()
    error = refused(MessagesApi(), body, f"messages.1.content.{REQUEST_LIMIT // (ITEM_LIMIT - 1024)}.signature")
    assert "in all" in error.message and time.perf_counter() - started < 2.0


@pytest.mark.kafka
def test_fault2_unbounded_decompression_is_a_400_over_http(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    anthropic_400(anthropic_post(session, anthropic_body(assistant=[thinking(bomb_value())])), "signature")
    gemini_400(gemini_post(session, gemini_body([{"text": "x", "thoughtSignature": bomb_value()}])),
               "contents.1.parts.0.thoughtSignature")
    responses_400(responses_post(session, responses_body({"type": "reasoning", "encrypted_content": bomb_value()})),
                  "input.1.encrypted_content")


# -- fault 3: damaged values of ours, and client values of the wrong JSON type ---------------------------

def test_fault3_signature_with_non_ascii_is_400() -> None:
    value = encode_reasoning("I will list them.")
    damaged = value[:20] + "é" + value[21:]
    error = refused(MessagesApi(), anthropic_body(assistant=[thinking(damaged)]), "messages.1.content.0.signature")
    assert "ASCII" in error.message
    refused(GeminiApi(), gemini_body([{"text": "x", "thoughtSignature": damaged}]),
            "contents.1.parts.0.thoughtSignature", GEMINI_ROUTE)
    refused(MessagesApi(), anthropic_body(assistant=[thinking("rwt1.ÄÖÜ")]), "messages.1.content.0.signature")


def test_fault3_encrypted_content_not_utf8_is_400() -> None:
    error = refused(ResponsesApi(), responses_body({"type": "reasoning", "encrypted_content": not_utf8_value()}),
                    "input.1.encrypted_content")
    assert "UTF-8" in error.message
    data = b"\xff\xfe"  # the old rwr1 format too
    old = "rwr1." + base64.urlsafe_b64encode(data).decode() + "." + hashlib.sha256(data).hexdigest()[:16]
    refused(ResponsesApi(), responses_body({"type": "reasoning", "encrypted_content": old}),
            "input.1.encrypted_content")


def test_fault3_foreign_reasoning_values_fall_back_to_the_visible_text() -> None:
    foreign = {"type": "thinking", "thinking": "visible", "signature": "EqQBCkgIARABGAIiQMR9kq2hGZfz"}
    request = MessagesApi().parse(anthropic_body(assistant=[foreign]), Route()).request
    assert request.messages[1].reasoning == "visible"
    mine = MessagesApi().parse(anthropic_body(assistant=[thinking(encode_reasoning("exact"))]), Route()).request
    assert mine.messages[1].reasoning == "exact"


@pytest.mark.parametrize("kind", [["text"], {"text": 1}])
def test_fault3_block_type_list_is_400_anthropic(kind: Any) -> None:
    api = MessagesApi()
    refused(api, anthropic_body(user=[{"type": kind, "text": "x"}]), "messages.1.content.0.type")
    refused(api, anthropic_body(assistant=[{"type": kind}]), "messages.1.content.0.type")
    refused(api, anthropic_body(system=[{"type": kind, "text": "x"}]), "system.0.type")
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": kind}]}
    refused(api, anthropic_body(user=[result]), "messages.1.content.0.content.0.type")
    reference = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "tool_reference", "tool_name": [1]}]}
    refused(api, anthropic_body(user=[reference], tools=[{"name": "x", "defer_loading": True}]),
            "messages.1.content.0.content.0.tool_name")
    refused(api, anthropic_body(user=["just a string"]), "messages.1.content.0")


@pytest.mark.parametrize("kind", [{"a": 1}, ["message"]])
def test_fault3_item_type_object_is_400_responses(kind: Any) -> None:
    api = ResponsesApi()
    refused(api, responses_body({"type": kind}), "input.1.type")
    message = {"type": "message", "role": "user", "content": [{"type": kind, "text": "x"}]}
    refused(api, responses_body(message), "input.1.content.0.type")
    refused(api, responses_body({"type": "message", "role": kind, "content": "x"}), "input.1.role")
    refused(api, responses_body({"type": "function_call", "call_id": kind, "name": "shell"}), "input.1.call_id")
    refused(api, responses_body({"type": "function_call", "call_id": "c", "name": kind}), "input.1.name")
    refused(api, responses_body({"type": "function_call", "call_id": "c", "name": "n", "namespace": kind}),
            "input.1.namespace")
    refused(api, responses_body({"type": "function_call_output", "call_id": kind, "output": "x"}), "input.1.call_id")
    refused(api, responses_body({"type": "reasoning", "encrypted_content": kind}), "input.1.encrypted_content")
    image = {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": kind}]}
    refused(api, responses_body(image), "input.1.content.0.image_url")
    refused(api, responses_body("not an item"), "input.1")  # type: ignore[arg-type]
    shell = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
    refused(api, responses_body(tools=[shell], tool_choice={"type": "function", "name": kind}), "tool_choice.name")
    refused(api, responses_body(tools=[shell], tool_choice={"type": kind}), "tool_choice.type")


def test_fault3_namespace_tool_without_type_is_400() -> None:
    api = ResponsesApi()
    nested = {"name": "spawn", "parameters": {"type": "object"}}
    refused(api, responses_body(tools=[{"type": "namespace", "name": "agents", "tools": [nested]}]),
            "tools.0.tools.0.type")
    refused(api, responses_body(tools=[{"name": "agents", "tools": [{"type": "function", "name": "x"}]}]),
            "tools.0.type")
    for name in (5, ["spawn"], {"n": 1}):
        refused(api, responses_body(tools=[{"type": "namespace", "name": "agents",
                                            "tools": [{"type": "function", "name": name}]}]), "tools.0.tools.0.name")
        refused(api, responses_body(tools=[{"type": "namespace", "name": name, "tools": []}]), "tools.0.name")
    refused(api, responses_body(tools=[{"type": "namespace", "name": "agents",
                                        "tools": [{"type": ["function"], "name": "spawn"}]}]), "tools.0.tools.0.type")
    refused(api, responses_body(tools=[{"type": "namespace", "name": "agents", "tools": ["spawn"]}]), "tools.0.tools.0")


@pytest.mark.kafka
def test_fault3_wrong_json_types_are_400_over_http(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    anthropic_400(anthropic_post(session, anthropic_body(user=[{"type": ["text"], "text": "x"}])),
                  "messages.1.content.0.type")
    anthropic_400(anthropic_post(session, anthropic_body(assistant=[thinking("rwt1.ÄÖÜ")])), "ASCII")
    responses_400(responses_post(session, responses_body({"type": {"a": 1}})), "input.1.type")
    responses_400(responses_post(session, responses_body({"type": "reasoning", "encrypted_content": not_utf8_value()})),
                  "input.1.encrypted_content")
    nested = {"type": "namespace", "name": "agents", "tools": [{"name": "spawn"}]}
    responses_400(responses_post(session, responses_body(tools=[nested])), "tools.0.tools.0.type")


# -- fault 8: Gemini CLI's router schema uses Gemini's upper-case type names ---------------------------

ROUTER_SCHEMA = {"type": "OBJECT", "properties": {
    "reasoning": {"type": "STRING", "description": "Why this model."},
    "model_choice": {"type": "STRING", "enum": ["flash", "pro"]},
    "scores": {"type": "ARRAY", "items": {"type": "NUMBER"}},
    "meta": {"type": ["OBJECT", "NULL"], "properties": {"n": {"type": "INTEGER"}, "ok": {"type": "BOOLEAN"}},
             "additionalProperties": {"type": "STRING"}},
    "pair": {"type": "ARRAY", "prefixItems": [{"type": "STRING"}, {"anyOf": [{"type": "INTEGER"}, {"type": "NULL"}]}]},
    "anything": {"type": "TYPE_UNSPECIFIED", "description": "no constraint"},
    "nullable": {"type": "STRING", "nullable": True}}, "required": ["reasoning", "model_choice"],
    "$defs": {"Leaf": {"type": "STRING"}}}
ROUTER_JSON_SCHEMA = {"type": "object", "properties": {
    "reasoning": {"type": "string", "description": "Why this model."},
    "model_choice": {"type": "string", "enum": ["flash", "pro"]},
    "scores": {"type": "array", "items": {"type": "number"}},
    "meta": {"type": ["object", "null"], "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
             "additionalProperties": {"type": "string"}},
    "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"anyOf": [{"type": "integer"}, {"type": "null"}]}]},
    "anything": {"description": "no constraint"},
    "nullable": {"type": ["string", "null"]}}, "required": ["reasoning", "model_choice"],
    "$defs": {"Leaf": {"type": "string"}}}


@pytest.mark.parametrize("field", ["responseJsonSchema", "responseSchema"])
def test_fault8_gemini_router_schema_upper_case_types(field: str) -> None:
    original = copy.deepcopy(ROUTER_SCHEMA)
    config = {"responseMimeType": "application/json", field: ROUTER_SCHEMA, "temperature": 0}
    request = GeminiApi().parse(gemini_body(generationConfig=config), GEMINI_ROUTE).request
    response_format = request.sampling.extra["response_format"]
    assert response_format == {"type": "json_schema", "json_schema": {"name": "response", "schema": ROUTER_JSON_SCHEMA}}
    assert ROUTER_SCHEMA == original  # the caller's document is left alone


def test_fault8_gemini_function_parameters_upper_case_types() -> None:
    declarations = [{"name": "a", "parameters": ROUTER_SCHEMA}, {"name": "b", "parametersJsonSchema": ROUTER_SCHEMA}]
    request = GeminiApi().parse(gemini_body(tools=[{"functionDeclarations": declarations}]), GEMINI_ROUTE).request
    assert [t.parameters for t in request.tools] == [ROUTER_JSON_SCHEMA, ROUTER_JSON_SCHEMA]
    # values that only look like type names are left alone
    assert json_schema({"enum": ["OBJECT"], "const": "STRING", "default": {"type": "ARRAY"}}) == {
        "enum": ["OBJECT"], "const": "STRING", "default": {"type": "ARRAY"}}


@pytest.mark.kafka
async def test_fault8_gemini_router_schema_reaches_the_engine_as_json_schema(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    config = {"responseMimeType": "application/json", "responseJsonSchema": ROUTER_SCHEMA}
    response = gemini_post(session, gemini_body(generationConfig=config))
    assert response.status_code == 200, response.text
    [event] = await proxy.completions(1)
    assert event.request.sampling.extra["response_format"]["json_schema"]["schema"] == ROUTER_JSON_SCHEMA


# -- sampled tool-call arguments that cannot be rendered as an object -----------------------------------

NASTY_ARGUMENTS = ["[" * 5000 + "]" * 5000, '{"a":' * 300 + "1" + "}" * 300, '{"n": 123456789012345678901234567890}',
                   '{"a": NaN}', "not json", '"a string"', "", '{"a": ' + "[" * 40 + "]" * 40 + "}"]


def _turn(arguments: str) -> EngineTurn:
    return EngineTurn([1], [2], [None], None, "thinking", [ToolCall(id="c1", name="shell", arguments=arguments)],
                      "tool_calls", Usage(prompt_tokens=1, completion_tokens=1))


@pytest.mark.parametrize("arguments", NASTY_ARGUMENTS)
def test_renderers_never_raise_on_sampled_arguments(arguments: str) -> None:
    anthropic = MessagesRenderer(parse_messages(anthropic_body(), need_max_tokens=True))
    [block] = [b for b in anthropic.response(_turn(arguments))["content"] if b["type"] == "tool_use"]
    assert isinstance(block["input"], dict)
    assert MessagesApi().parse(anthropic_body(), Route()).renderer.stream_whole(_turn(arguments))
    for api, document, route in ((GeminiApi(), gemini_body(), GEMINI_ROUTE),
                                 (ResponsesApi(), responses_body(), Route())):
        assert api.parse(document, route).renderer.response(_turn(arguments))
        assert api.parse(document, route).renderer.stream_whole(_turn(arguments))
    assert isinstance(custom_input(arguments), str)


# -- fuzzing parse with the recorded harness bodies as seeds -----------------------------------------------

def _seed(path: Path) -> dict:
    document = json.loads(path.read_text())
    return document["body"] if "body" in document else document


SEEDS: dict[str, tuple[Any, Route, list[dict]]] = {
    "anthropic": (MessagesApi(), Route(), [_seed(p) for p in sorted((HARNESSES / "claude-code").glob("call_*.json"))]),
    "responses": (ResponsesApi(), Route(), [_seed(p) for p in sorted((HARNESSES / "codex").glob("*.json"))]),
    "gemini": (GeminiApi(), GEMINI_ROUTE, [_seed(p) for p in sorted((HARNESSES / "pi-gemini").glob("*.json"))]),
}
_KEYS = ["type", "role", "name", "id", "call_id", "content", "text", "signature", "input", "tools", "parts",
         "functionCall", "thoughtSignature", "encrypted_content", "namespace", "output", "tool_name", "properties"]
_WORDS = ["text", "thinking", "tool_use", "tool_result", "message", "reasoning", "function_call", "namespace",
          "function", "user", "model", "OBJECT", "rwt1.", "rollwire", "cncxeJ", "rwr1.a.b"]
_SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | st.sampled_from(_WORDS))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=6), inner, max_size=3), max_leaves=8)


def _paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += _paths(value, (*prefix, index))
    return found


def _nested(depth: int) -> Any:
    value: Any = "x"
    for level in range(depth):
        value = [value] if level % 2 else {"type": value}
    return value


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(SEEDS)), st.data())
def test_parse_of_mutated_harness_bodies_raises_only_proxy_errors(api_name: str, data: st.DataObject) -> None:
    api, route, seeds = SEEDS[api_name]
    document = copy.deepcopy(data.draw(st.sampled_from(seeds)))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(document)))
        value = data.draw(_VALUES | st.integers(1, 60).map(_nested))
        if not path:
            document = value
            continue
        node = document
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value
    try:
        api.parse(document, route)
    except ProxyError:
        pass
