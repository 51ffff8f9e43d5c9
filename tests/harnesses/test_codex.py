"""The real Codex CLI (``@openai/codex``, Responses API only) runs sessions through the proxy: a text-only
session, and multi-turn sessions in which the model calls Codex's own tools (``exec_command``, its shell,
and the freeform ``apply_patch``), Codex runs them (a file appears in the workspace), sends the results
back and ends on a text answer with exit 0. Every call is a completion event on the ``openai.responses``
API with token ids, and each call's prompt extends the previous call's prompt + sampled tokens.

The model's output is scripted by the session's ``engine.turns`` (``structured_outputs.regex`` literals):
the stand-in engine serves the fast sessions, the real vLLM CPU server one shell session. Codex runs with
a throwaway HOME and ``CODEX_HOME`` holding a config.toml that points a custom provider at the session's
OpenAI base URL (docs/harnesses.md), telemetry and plugins off, with only loopback reachable
(``tests.harnesses.isolation``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from schemas.transport import KafkaSettings
from tests.harnesses.codex_runs import (
    CATALOG_MODEL, PLAIN_MODEL, PROOF, PROOF_TEXT, patch_script, run_codex, scripted, shell_script)
from tests.harnesses.common import (
    ReasoningEngine,
    Script,
    SessionRun,
    assert_calls_recorded as assert_events_recorded,
    assert_no_server_errors,
    assert_prefix_chain,
    assert_prompt_text_chain,
    serve_proxy,
    standin_proxy,  # noqa: F401  (fixture)
    vllm_proxy,  # noqa: F401  (fixture)
)
from tests.proxy.conftest import ProxyUnderTest
from tests.proxy.conftest import standin_url  # noqa: F401  (the stand-in engine fixture, module-scoped)

pytestmark = pytest.mark.kafka


# -- what every session must show ------------------------------------------------------------------------


def assert_finished(run: SessionRun, answer: str) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert answer in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ERROR" not in run.stderr, run.stderr[-3000:]


def assert_calls_recorded(run: SessionRun, calls: int) -> None:
    """One ok completion event per scripted turn, on the Responses API, with token ids; no retry."""
    assert_events_recorded(run, "openai.responses", calls, min_prompt_tokens=1000)
    for event in run.events:
        body = json.loads(event.request_body)
        assert body["stream"] is True and body["store"] is False
        assert {t.name for t in event.request.tools} >= {"exec_command"}
        assert not {t.name for t in event.request.tools} & {"web_search", "tool_search"}


def assert_tool_round_trip(run: SessionRun, script: Script, kind: str) -> None:
    """Turn 0 called the scripted tool; call 1 answers it by id with a non-empty result; the last turn is text."""
    [step] = script.steps
    first, last = run.events[0], run.events[-1]
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert call.name == step.name and json.loads(call.arguments) == step.arguments
    echoed = [c for m in last.request.messages for c in m.tool_calls if c.id == call.id]
    assert len(echoed) == 1 and echoed[0].kind == kind and json.loads(echoed[0].arguments) == step.arguments
    answered = [m for m in last.request.messages if m.role == "tool" and m.tool_call_id == call.id]
    assert len(answered) == 1 and answered[0].content
    assert last.finish_reason == "stop" and last.message.content == script.answer


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "codex"


def wire_shape(body: dict[str, Any]) -> dict[str, Any]:
    """What a Codex request looks like without its text: fields, input items, tools, options."""
    return {"fields": sorted(body), "input": [(i.get("type"), i.get("role")) for i in body["input"]],
            "tools": [(t["type"], t.get("name"), sorted(t)) for t in body["tools"]],
            "options": {k: body.get(k) for k in ("stream", "store", "include", "tool_choice", "parallel_tool_calls",
                                                 "reasoning", "text")}}


def assert_wire_matches_fixtures(run: SessionRun, name: str) -> None:
    """The live bodies have the shape of the recorded ones (tests/fixtures/harnesses/codex/, whose own tests
    in tests/proxy/test_openai_responses.py say what the normalizer makes of them)."""
    for event in run.events:
        path = FIXTURES / f"{name}_{event.sequence}.json"
        if path.exists():
            recorded = json.loads(path.read_text())["body"]
            assert wire_shape(json.loads(event.request_body)) == wire_shape(recorded), (
                f"Codex {name} call {event.sequence} changed its wire format: re-record with "
                "tests/fixtures/harnesses/record_codex.py and check the normalizer tests")


# -- the sessions ----------------------------------------------------------------------------------------


async def test_codex_text_session(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:  # noqa: F811
    answer = "Hello from the rollwire proxy."
    engine = {"max_tokens": 256, "seed": 1, "turns": [{"structured_outputs": {"regex": re.escape(answer)}}]}
    run = await run_codex(standin_proxy, tmp_path, "Say hello.", engine)
    assert_finished(run, answer)
    assert_calls_recorded(run, 1)
    assert run.events[0].message.content == answer and run.events[0].finish_reason == "stop"
    assert [m.role for m in run.events[0].request.messages][:2] == ["developer", "developer"]
    assert_no_server_errors(standin_proxy, "openai.responses", 1)


async def test_codex_shell_tool_session(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:  # noqa: F811
    script = shell_script()
    run = await run_codex(standin_proxy, tmp_path, f"Create {PROOF}.", scripted(script, 512, 7))
    assert_finished(run, script.answer)
    assert (run.workspace / PROOF).read_text() == PROOF_TEXT
    assert_calls_recorded(run, script.calls)
    assert_tool_round_trip(run, script, "function")
    assert_prefix_chain(run)
    assert_no_server_errors(standin_proxy, "openai.responses", script.calls)
    assert_wire_matches_fixtures(run, "shell")


async def test_codex_apply_patch_session(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:  # noqa: F811
    """The freeform tool: offered to the engine as a one-string function, the call goes back to Codex as a
    custom_tool_call whose input is the patch, and comes back as custom_tool_call + its output."""
    script = patch_script()
    run = await run_codex(standin_proxy, tmp_path, f"Create {PROOF}.", scripted(script, 512, 7), CATALOG_MODEL)
    assert_finished(run, script.answer)
    assert (run.workspace / PROOF).read_text() == PROOF_TEXT
    assert_calls_recorded(run, script.calls)
    [patch_tool] = [t for t in run.events[0].request.tools if t.name == "apply_patch"]
    assert patch_tool.kind == "custom" and patch_tool.grammar["syntax"] == "lark"
    assert_tool_round_trip(run, script, "custom")
    assert_prefix_chain(run)
    assert_no_server_errors(standin_proxy, "openai.responses", script.calls)
    assert_wire_matches_fixtures(run, "patch")


async def test_codex_echoes_reasoning_back_through_encrypted_content(
        kafka: KafkaSettings, standin_url: str, tmp_path: Path) -> None:  # noqa: F811
    """Codex keeps the reasoning item of a tool turn and sends it back with its ``encrypted_content``; the
    proxy decodes it to the very text the engine produced, so the next prompt holds that reasoning."""
    thought = "The user wants a proof file; one shell command writes it. ✓"
    transport = ReasoningEngine(thought)
    with serve_proxy(standin_url, kafka, record_request_body=True, engine_transport=transport) as proxy:
        script = shell_script()
        run = await run_codex(proxy, tmp_path, f"Create {PROOF}.", scripted(script, 512, 7))
    assert_finished(run, script.answer)
    assert_calls_recorded(run, script.calls)
    first, second = run.events
    assert first.message.reasoning == thought
    [echoed] = [i for i in json.loads(second.request_body)["input"] if i.get("type") == "reasoning"]
    assert echoed["encrypted_content"] and thought not in echoed["encrypted_content"]
    [assistant] = [m for m in second.request.messages if m.role == "assistant"]
    assert assistant.reasoning == thought and assistant.tool_calls[0].name == "exec_command"
    assert f"<think>{thought}</think>".encode() in bytes(second.prompt_token_ids.tolist())


@pytest.mark.parametrize(("name", "model", "kind"), [("shell", PLAIN_MODEL, "function"),
                                                     ("patch", CATALOG_MODEL, "custom")])
async def test_codex_tool_session_against_real_vllm(vllm_proxy: ProxyUnderTest,  # noqa: F811
                                                    vllm_url: str, tmp_path: Path, name: str, model: str,
                                                    kind: str) -> None:
    """The same sessions on the real engine: guided decoding forces the text, vLLM's hermes parser makes it
    a tool call, the proxy a function_call (or custom_tool_call) item, and Codex runs it."""
    script = shell_script() if name == "shell" else patch_script()
    run = await run_codex(vllm_proxy, tmp_path, f"Create {PROOF}.", scripted(script, 256, 11), model)
    assert_finished(run, script.answer)
    assert (run.workspace / PROOF).read_text() == PROOF_TEXT
    assert_calls_recorded(run, script.calls)
    assert_tool_round_trip(run, script, kind)
    assert_prompt_text_chain(run, vllm_url)
    assert_no_server_errors(vllm_proxy, "openai.responses", script.calls)
