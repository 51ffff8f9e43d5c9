"""The embedded engine's ``rollwire_forced_tokens`` logits processor (deploy/engine/plugins).

A request with ``vllm_xargs: {"rollwire_forced_tokens": [ids]}`` must sample exactly those ids (special
tokens included), then stop on end-of-sequence; the hermes parser must still see the tool call; the next
prompt, with that tool call echoed back, must extend the prompt plus the sampled ids token for token
(what prefix-merged trajectories need); a malformed field is a 400; other requests are untouched. The
launcher tests need no vLLM; the others use the session's real server (``vllm_url`` in tests/conftest.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.engine.plugins import FORCED_TOKENS_ARG, FORCED_TOKENS_PROCESSOR
from deploy.engine.server import PLUGIN_DIR, EngineConfig, server_command, server_env

pytestmark = pytest.mark.timeout(1800)  # the first server test may start the engine

MODEL = "rollwire-tiny"
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "shell", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
MESSAGES: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": "Say hi in the shell."}]
CALL_TEXT = '<tool_call>\n{"name": "shell", "arguments": {"command": "echo hi"}}\n</tool_call>'
TOOL_CALL_ID, TOOL_CALL_END_ID, IM_END_ID = 151657, 151658, 151645


# --- launcher, without vLLM -----------------------------------------------------------------------


def test_server_loads_the_processor_from_the_plugin_directory(tmp_path: Path) -> None:
    config = EngineConfig(cache_dir=tmp_path, home=tmp_path / "home")
    command = server_command(Path("/venv/bin/python"), config, config.model_dir)
    assert command[command.index("--logits-processors") + 1] == FORCED_TOKENS_PROCESSOR
    module, _, cls = FORCED_TOKENS_PROCESSOR.partition(":")
    source = (PLUGIN_DIR / f"{module}.py").read_text()
    assert f"class {cls}(" in source and f'FORCED_TOKENS_ARG = "{FORCED_TOKENS_ARG}"' in source
    env = server_env(config, {"PATH": "/bin", "PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(":") == [str(PLUGIN_DIR), "/elsewhere"]
    assert server_env(config, {"PATH": "/bin"})["PYTHONPATH"] == str(PLUGIN_DIR)


# --- the real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(vllm_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_url, timeout=120) as engine:
        yield engine


def _ids(client: httpx.Client, text: str) -> list[int]:
    response = client.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def _chat(client: httpx.Client, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, "seed": 5,
            "temperature": 1.0, "return_token_ids": True, "logprobs": True, **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_forced_ids_are_sampled_exactly_and_parsed_as_a_tool_call(client: httpx.Client) -> None:
    ids = _ids(client, CALL_TEXT + "<|im_end|>")
    assert ids[0] == TOOL_CALL_ID and ids[-2:] == [TOOL_CALL_END_ID, IM_END_ID]
    reply = _chat(client, vllm_xargs={FORCED_TOKENS_ARG: ids})
    choice = reply["choices"][0]
    assert choice["token_ids"] == ids and choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "shell" and json.loads(call["function"]["arguments"]) == {"command": "echo hi"}
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(logprobs) == len(ids) and all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)

    # The tool call echoed back: the next prompt extends this prompt plus the sampled ids, token for token.
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "hi"}]
    following = client.post("/tokenize", json={"model": MODEL, "messages": history, "tools": TOOLS,
                                               "add_generation_prompt": True}).json()["tokens"]
    head = reply["prompt_token_ids"] + ids
    assert following[:len(head)] == head and len(following) > len(head)


def test_forced_ids_then_end_of_sequence_and_streamed(client: httpx.Client) -> None:
    """Ids without the end token: the request still stops, on ``<|im_end|>``; a comma-separated string
    works too, and the stream carries the same ids."""
    ids = _ids(client, "All done.")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "seed": 5, "return_token_ids": True,
            "logprobs": True, "stream": True, "vllm_xargs": {FORCED_TOKENS_ARG: ",".join(map(str, ids))}}
    streamed: list[int] = []
    text = ""
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                for choice in chunk["choices"]:
                    streamed += choice.get("token_ids") or []
                    text += choice["delta"].get("content") or ""
    assert streamed == [*ids, IM_END_ID] and text == "All done."


def test_requests_without_the_field_are_untouched(client: httpx.Client) -> None:
    ids = _ids(client, CALL_TEXT + "<|im_end|>")
    plain = _chat(client)["choices"][0]["token_ids"]
    assert plain == _chat(client)["choices"][0]["token_ids"]  # same seed, same ids
    assert plain[:len(ids)] != ids


@pytest.mark.parametrize("bad", ["1,x", [], "", [1.5, 2]])
def test_malformed_field_is_a_400_naming_it(client: httpx.Client, bad: Any) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "vllm_xargs": {FORCED_TOKENS_ARG: bad}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert FORCED_TOKENS_ARG in response.text
    assert client.get("/health").status_code == 200  # the engine core survived


# --- the stand-in engine (tests/support/standin_engine.py) honours the same turn ----------------------------


async def test_standin_replies_with_a_forced_turns_text_or_ids() -> None:
    """A turn forced for the real engine carries its text for the stand-in: the stand-in says it (a tool
    call comes back as tool_calls); given only ids, it returns them as its sampled ids."""
    from tests.support.standin_engine import FORCED_TEXT_ARG, StandinConfig, create_app

    transport = httpx.ASGITransport(app=create_app(StandinConfig(latency_ms=0)))
    async with httpx.AsyncClient(transport=transport, base_url="http://standin") as standin:
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 256,
                "vllm_xargs": {FORCED_TOKENS_ARG: [TOOL_CALL_ID, 198, TOOL_CALL_END_ID], FORCED_TEXT_ARG: CALL_TEXT}}
        choice = (await standin.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"command": "echo hi"}
        assert bytes(choice["token_ids"]).decode() == CALL_TEXT  # the stand-in's one token per byte

        ids = [TOOL_CALL_ID, 104, 105, IM_END_ID]
        for stream in (False, True):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "stream": stream,
                    "vllm_xargs": {FORCED_TOKENS_ARG: ",".join(map(str, ids))}}
            response = await standin.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            if not stream:
                choice = response.json()["choices"][0]
                assert choice["token_ids"] == ids and choice["message"]["content"] == "hi"
                assert len(choice["logprobs"]["content"]) == len(ids)
            else:
                chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == ids


async def test_standin_streams_a_character_split_across_tokens_once_it_is_whole() -> None:
    """One token per byte: "é" and "日" span several tokens. As vLLM's detokenizer does, the stand-in holds
    a character back until its last byte (empty text before), so the streamed text is the whole reply's."""
    from tests.support.standin_engine import FORCED_TEXT_ARG, StandinConfig, create_app

    text = "héllo 日本 ✓"
    transport = httpx.ASGITransport(app=create_app(StandinConfig(latency_ms=0)))
    async with httpx.AsyncClient(transport=transport, base_url="http://standin") as standin:
        replies = {}
        for stream in (False, True):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "stream": stream,
                    "vllm_xargs": {FORCED_TEXT_ARG: text}}
            response = await standin.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            if not stream:
                replies[stream] = response.json()["choices"][0]["message"]["content"]
                continue
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            pieces = [ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]]
            assert all("\ufffd" not in piece for piece in pieces)
            assert "" in pieces  # a token whose character was not whole yet
            replies[stream] = "".join(pieces)
    assert replies == {False: text, True: text}
