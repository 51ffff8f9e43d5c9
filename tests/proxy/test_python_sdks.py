"""The official Python SDKs as clients: ``openai`` (Chat Completions and Responses), ``anthropic``
(Messages) and ``google-genai`` (the Gemini API), each streaming a forced tool call through its own stream helper (which parses every event
into the SDK's typed models and fails on a grammar it does not know), then sending the tool result back
and reading a whole reply. Every call is on the completions topic and the second prompt extends the first
prompt + sampled ids token for token. Bad input raises the SDK's own ``BadRequestError`` with the
proxy's message, and a wrong key its ``AuthenticationError``: the error bodies are shaped as each
provider's, so a client's error handling works unchanged. (Agent frameworks in Python reach models
through these SDKs; the CLIs' own clients are covered in tests/harnesses/.)
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types

from tests.proxy.conftest import ProxyUnderTest

pytestmark = pytest.mark.kafka

ARGUMENTS = {"cmd": "cat README.md"}
SHELL_SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}


def forced_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A turn in which the model emits exactly this tool call (a hermes block, as the template writes it)."""
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    return {"structured_outputs": {"regex": re.escape(text)}}


def forced_text(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": re.escape(text)}}


def tool_session(proxy: ProxyUnderTest, answer: str) -> dict:
    return proxy.new_session(engine={"turns": [forced_call("shell", ARGUMENTS), forced_text(answer)]})


async def assert_second_extends_first(proxy: ProxyUnderTest, api: str) -> None:
    first, second = await proxy.completions(2)
    assert (first.api, second.api) == (api, api) and first.status == second.status == "ok"
    head = first.prompt_token_ids.tolist() + first.token_ids.tolist()
    assert second.prompt_token_ids.tolist()[:len(head)] == head
    assert second.request.messages[-1].role == "tool"


def openai_client(session: dict, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session["base_urls"]["openai"], api_key=key or session["api_key"],
                              max_retries=0, timeout=30)


def anthropic_client(session: dict, key: str | None = None) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=session["base_urls"]["anthropic"], api_key=key or session["api_key"],
                                    max_retries=0, timeout=30)


async def test_openai_chat_completions_stream_a_tool_call_and_answer(proxy: ProxyUnderTest) -> None:
    session = tool_session(proxy, "The readme says hello.")
    client = openai_client(session)
    messages: list[Any] = [{"role": "system", "content": "You are a coding agent."},
                           {"role": "user", "content": "What does the readme say?"}]
    tools: list[Any] = [{"type": "function", "function": {"name": "shell", "description": "Run a command",
                                                          "parameters": SHELL_SCHEMA}}]
    async with client.chat.completions.stream(model="m", messages=messages, tools=tools, max_tokens=200,
                                              stream_options={"include_usage": True}) as stream:
        async for _ in stream:
            pass
        streamed = await stream.get_final_completion()
    choice = streamed.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "shell" and call.id
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert streamed.usage is not None and streamed.usage.completion_tokens > 0
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "hello"}]
    whole = await client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=200)
    assert whole.choices[0].message.content == "The readme says hello."
    assert whole.choices[0].finish_reason == "stop"
    await assert_second_extends_first(proxy, "openai.chat")


async def test_openai_responses_stream_a_tool_call_and_answer(proxy: ProxyUnderTest) -> None:
    session = tool_session(proxy, "It says hello.")
    client = openai_client(session)
    tools: list[Any] = [{"type": "function", "name": "shell", "description": "Run a command",
                         "parameters": SHELL_SCHEMA, "strict": False}]
    request: list[Any] = [{"role": "user", "content": "What does the readme say?"}]
    async with client.responses.stream(model="m", instructions="You are a coding agent.", input=request,
                                       tools=tools, max_output_tokens=200) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    [call] = [item for item in streamed.output if item.type == "function_call"]
    assert call.name == "shell" and json.loads(call.arguments) == ARGUMENTS and call.call_id
    request += [call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "hello"}]
    whole = await client.responses.create(model="m", instructions="You are a coding agent.", input=request,
                                          tools=tools, max_output_tokens=200)
    assert whole.status == "completed" and whole.output_text == "It says hello."
    await assert_second_extends_first(proxy, "openai.responses")


async def test_anthropic_messages_stream_a_tool_use_and_answer(proxy: ProxyUnderTest) -> None:
    session = tool_session(proxy, "Hello, it says.")
    client = anthropic_client(session)
    tools: list[Any] = [{"name": "shell", "description": "Run a command", "input_schema": SHELL_SCHEMA}]
    messages: list[Any] = [{"role": "user", "content": "What does the readme say?"}]
    async with client.messages.stream(model="m", system="You are a coding agent.", messages=messages, tools=tools,
                                      max_tokens=200) as stream:
        async for _ in stream:
            pass
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    [use] = [block for block in streamed.content if block.type == "tool_use"]
    assert use.name == "shell" and use.input == ARGUMENTS and use.id
    assert streamed.usage.output_tokens > 0
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                   for block in streamed.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hello"}]}]
    whole = await client.messages.create(model="m", system="You are a coding agent.", messages=messages,
                                         tools=tools, max_tokens=200)
    assert whole.stop_reason == "end_turn"
    assert [block.text for block in whole.content if block.type == "text"] == ["Hello, it says."]
    await assert_second_extends_first(proxy, "anthropic.messages")


def gemini_client(session: dict, key: str | None = None) -> genai.Client:
    return genai.Client(api_key=key or session["api_key"], http_options=genai_types.HttpOptions(
        base_url=session["base_urls"]["gemini"], timeout=30_000,
        retry_options=genai_types.HttpRetryOptions(attempts=1)))


async def test_google_genai_streams_a_function_call_and_answers(proxy: ProxyUnderTest) -> None:
    session = tool_session(proxy, "Hello is what it says.")
    client = gemini_client(session)
    shell = genai_types.FunctionDeclaration(name="shell", description="Run a command",
                                            parameters_json_schema=SHELL_SCHEMA)
    config = genai_types.GenerateContentConfig(
        system_instruction="You are a coding agent.", tools=[genai_types.Tool(function_declarations=[shell])],
        max_output_tokens=200, automatic_function_calling=genai_types.AutomaticFunctionCallingConfig(disable=True))
    contents: list[Any] = [genai_types.Content(role="user", parts=[genai_types.Part(text="What does the readme say?")])]
    parts: list[genai_types.Part] = []
    async for chunk in await client.aio.models.generate_content_stream(model="m", contents=contents, config=config):
        if chunk.candidates and chunk.candidates[0].content and chunk.candidates[0].content.parts:
            parts += chunk.candidates[0].content.parts
    [call] = [part.function_call for part in parts if part.function_call]
    assert call.name == "shell" and call.args == ARGUMENTS
    contents += [genai_types.Content(role="model", parts=parts),
                 genai_types.Content(role="user", parts=[genai_types.Part(function_response=genai_types.FunctionResponse(
                     id=call.id, name="shell", response={"output": "hello"}))])]
    whole = await client.aio.models.generate_content(model="m", contents=contents, config=config)
    assert whole.text == "Hello is what it says."
    assert whole.candidates and whole.candidates[0].finish_reason == genai_types.FinishReason.STOP
    assert whole.usage_metadata is not None and whole.usage_metadata.candidates_token_count
    counted = await client.aio.models.count_tokens(model="m", contents="What does the readme say?")
    assert counted.total_tokens and counted.total_tokens > 0
    # GET /v1/models is OpenAI's path too: a Gemini client (its key in x-goog-api-key) gets Gemini's shape.
    described = await client.aio.models.get(model="m")
    assert described.name == "models/m" and described.input_token_limit
    listed = [model.name async for model in await client.aio.models.list()]
    assert len(listed) == 1 and listed[0] and listed[0].startswith("models/")
    await assert_second_extends_first(proxy, "gemini")


async def test_sdk_errors_are_the_providers_own(proxy: ProxyUnderTest) -> None:
    session = proxy.new_session()
    chat = openai_client(session)
    with pytest.raises(openai.BadRequestError) as bad_chat:
        await chat.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "hi"}])  # type: ignore[misc,list-item]
    assert bad_chat.value.status_code == 400 and "role" in bad_chat.value.message
    with pytest.raises(openai.BadRequestError) as bad_responses:
        await chat.responses.create(model="m", input=[{"type": "no_such_item"}])  # type: ignore[list-item]
    assert "no_such_item" in bad_responses.value.message
    with pytest.raises(openai.AuthenticationError):
        await openai_client(session, key="not-the-key").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    messages = anthropic_client(session)
    with pytest.raises(anthropic.BadRequestError) as bad_messages:
        await messages.messages.create(model="m", max_tokens=-1, messages=[{"role": "user", "content": "hi"}])
    assert bad_messages.value.status_code == 400 and "max_tokens" in bad_messages.value.message
    body = bad_messages.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic_client(session, key="not-the-key").messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    gemini = gemini_client(session)
    with pytest.raises(genai_errors.ClientError) as bad_gemini:
        await gemini.aio.models.generate_content(model="m", contents=[{"role": "wizard", "parts": [{"text": "hi"}]}])
    assert bad_gemini.value.code == 400 and bad_gemini.value.status == "INVALID_ARGUMENT"
    assert "contents.0.role" in (bad_gemini.value.message or "")
    with pytest.raises(genai_errors.ClientError) as refused:
        await gemini_client(session, key="not-the-key").aio.models.generate_content(model="m", contents="hi")
    assert refused.value.code in (401, 403), refused.value
