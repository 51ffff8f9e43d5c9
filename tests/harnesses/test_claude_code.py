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
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from producers.harness_install import HARNESSES, ensure_harness
from proxy.anthropic_messages import BILLING_PREFIX, MessagesApi
from proxy.app import create_app
from proxy.providers import Route
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.harnesses.isolation import run_harness
from tests.proxy.conftest import ProxyUnderTest, proxy_settings
from tests.proxy.conftest import standin_url  # noqa: F401  (the stand-in engine fixture, module-scoped)
from tests.servers import serve

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "claude-code"
MODEL = "claude-sonnet-4-5"
INSTRUCTION = "Create notes.txt with the line alpha, then append the line beta, then say what you did."
ANSWER = "notes.txt now holds alpha and beta."
_REGEX_SPECIALS = set(".^$*+?()[]{}|\\/")


# -- scripted model output ---------------------------------------------------------------------------

def literal_regex(text: str) -> str:
    """A regex matching exactly ``text`` (both engines read it as a literal)."""
    out = []
    for ch in text:
        out.append("\\" + ch if ch in _REGEX_SPECIALS else {"\n": "\\n", "\t": "\\t"}.get(ch, ch))
    return "".join(out)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """The hermes block the model is forced to write. The arguments use ``json.dumps``' default layout:
    that is how vLLM's parser hands them out and how the proxy serializes Claude Code's echoed
    ``tool_use.input``, so the next prompt holds the sampled bytes again."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


@dataclass(frozen=True)
class Script:
    tools: tuple[tuple[str, dict[str, Any]], ...]
    answer: str
    expected_files: dict[str, str]

    @property
    def calls(self) -> int:
        return len(self.tools) + 1

    def turns(self) -> list[dict[str, Any]]:
        texts = [tool_call_text(name, arguments) for name, arguments in self.tools] + [self.answer]
        return [{"structured_outputs": {"regex": literal_regex(text)}} for text in texts]


def tool_script(workspace: Path) -> Script:
    # Write wants an absolute path; Bash runs in the workspace (the cwd).
    return Script(tools=(("Write", {"file_path": str(workspace / "notes.txt"), "content": "alpha\n"}),
                         ("Bash", {"command": "echo beta >> notes.txt", "description": "Append beta to notes.txt"})),
                  answer=ANSWER, expected_files={"notes.txt": "alpha\nbeta\n"})


def text_script(workspace: Path) -> Script:
    return Script(tools=(), answer="Hello from rollwire.", expected_files={})


# -- running Claude Code -----------------------------------------------------------------------------

def claude_env(session: dict[str, Any], home: Path) -> dict[str, str]:
    """The environment of a headless, isolated Claude Code on a proxy session (see HARNESSES.md)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "ROLLWIRE_", "CLAUDE"))}
    return {**base, "HOME": str(home), "ANTHROPIC_BASE_URL": session["base_urls"]["anthropic"],
            "ANTHROPIC_API_KEY": session["api_key"], "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1"}


@dataclass
class SessionRun:
    script: Script
    session: dict[str, Any]
    home: Path
    workspace: Path
    returncode: int
    stdout: str
    stderr: str
    events: list[Completion]
    session_calls: int

    def result(self) -> dict[str, Any]:
        return json.loads(self.stdout.strip().splitlines()[-1])


async def run_claude(proxy: ProxyUnderTest, root: Path, script_for: Any, *, max_tokens: int, seed: int) -> SessionRun:
    """Run Claude Code once in ``root/workspace`` (HOME ``root/home``) on a session scripted by ``script_for``."""
    home, workspace = root / "home", root / "workspace"
    home.mkdir(parents=True)
    workspace.mkdir(parents=True)
    script = script_for(workspace)
    session = proxy.new_session(engine={"max_tokens": max_tokens, "seed": seed, "turns": script.turns()})
    command = [str(ensure_harness("claude-code")), "-p", INSTRUCTION, "--output-format", "json",
               "--dangerously-skip-permissions"]
    result = run_harness(command, cwd=workspace, env=claude_env(session, home), proxy_url=proxy.url)
    calls = httpx.get(f"{proxy.url}/v1/sessions/{session['session_id']}", timeout=30).json()["calls"]
    events = [e for e in await proxy.completions(calls) if e.session_id == session["session_id"]]
    return SessionRun(script, session, home, workspace, result.returncode, result.stdout, result.stderr,
                      sorted(events, key=lambda e: e.sequence), calls)


# -- what every session must show --------------------------------------------------------------------

def assert_finished(run: SessionRun) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = run.result()
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert result["result"] == run.script.answer
    assert result["num_turns"] == run.script.calls
    for name, content in run.script.expected_files.items():
        path = run.workspace / name
        assert path.is_file(), f"Claude Code did not run its tools: no {name}\n{run.stdout[-3000:]}"
        assert path.read_text() == content


def assert_calls_recorded(run: SessionRun) -> None:
    """One ok, streamed event per scripted turn (no retry, no non-streaming repeat, no side call)."""
    assert run.session_calls == run.script.calls, [e.request.messages[-1] for e in run.events]
    assert [e.sequence for e in run.events] == list(range(run.script.calls))
    for event in run.events:
        assert event.status == "ok", event.error
        assert event.api == "anthropic.messages" and event.requested_model == MODEL
        assert event.request.stream is True and json.loads(event.request_body)["stream"] is True
        assert event.retry_count == 0 and event.retry_of is None
        assert event.prompt_token_ids is not None and len(event.prompt_token_ids) > 1000
        assert event.token_ids is not None and len(event.token_ids) > 0
        assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)
        assert event.agent_hints.get("user-agent", "").startswith("claude-cli/")
        assert BILLING_PREFIX not in (event.request.messages[0].content or "")


def assert_tool_round_trips(run: SessionRun) -> None:
    for k, (name, arguments) in enumerate(run.script.tools):
        event, following = run.events[k], run.events[k + 1]
        assert event.finish_reason == "tool_calls"
        [call] = event.message.tool_calls
        assert call.name == name and json.loads(call.arguments) == arguments
        answered = [m for m in following.request.messages if m.role == "tool" and m.tool_call_id == call.id]
        assert len(answered) == 1 and answered[0].content and not answered[0].is_error, answered
        echoed = [c for m in following.request.messages for c in m.tool_calls if c.id == call.id]
        assert len(echoed) == 1 and echoed[0].arguments == call.arguments
    last = run.events[-1]
    assert last.finish_reason == "stop" and last.message.content == run.script.answer


def assert_prefix_chain(run: SessionRun) -> None:
    """Call k+1's prompt starts with call k's prompt and sampled tokens: Claude Code keeps its history
    append-only (its billing line, which changes per call, is dropped by the proxy)."""
    for earlier, later in zip(run.events, run.events[1:]):
        head = earlier.prompt_token_ids.tolist() + earlier.token_ids.tolist()
        prompt = later.prompt_token_ids.tolist()
        first_difference = next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b),
                                min(len(head), len(prompt)))
        assert len(prompt) > len(head) and first_difference == len(head), (
            f"call {later.sequence} does not extend call {earlier.sequence}: first difference at token "
            f"{first_difference} of {len(head)}")


_END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


def assert_prompt_text_chain(run: SessionRun, engine_url: str) -> None:
    """On the real engine: call k+1's prompt starts with call k's prompt token for token (Claude Code's
    history is append-only), and the text after it starts with the text call k sampled. The sampled ids
    themselves do not come back: under guided decoding the model writes ``<tool_call>`` as ordinary text
    pieces where the template writes one special token (the engine re-tokenizing text, not the CLI
    rewriting history; why a trajectory keeps each call's sampled ids)."""
    for earlier, later in zip(run.events, run.events[1:]):
        prompt, sampled = earlier.prompt_token_ids.tolist(), earlier.token_ids.tolist()
        assert later.prompt_token_ids.tolist()[:len(prompt)] == prompt, f"call {later.sequence} rewrote the history"
        said = _detokenize(engine_url, sampled)
        for end in _END_OF_TURN:
            said = said.removesuffix(end)
        following = _detokenize(engine_url, later.prompt_token_ids.tolist()[len(prompt):])
        assert following.startswith(said), (said, following[:len(said) + 40])


def _detokenize(engine_url: str, ids: list[int]) -> str:
    response = httpx.post(f"{engine_url}/detokenize", json={"tokens": ids}, timeout=60)
    response.raise_for_status()
    return response.json()["prompt"]


def assert_no_server_errors(proxy: ProxyUnderTest, calls: int) -> None:
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=30).text
    answered = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^rollwire_proxy_requests_total\{api="anthropic\.messages",status="(\d+)"\} (\S+)$', metrics, re.M)}
    assert answered == {"200": float(calls)}, answered


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


def assert_wire_matches_fixtures(run: SessionRun) -> None:
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

@pytest.fixture
def standin_proxy(kafka: KafkaSettings, standin_url: str) -> Iterator[ProxyUnderTest]:  # noqa: F811
    with serve(create_app(proxy_settings(standin_url, record_request_body=True), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


@pytest.mark.kafka
async def test_text_session_against_standin(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    run = await run_claude(standin_proxy, tmp_path, text_script, max_tokens=256, seed=5)
    assert_finished(run)
    assert_calls_recorded(run)
    assert run.events[0].finish_reason == "stop" and not run.events[0].message.tool_calls
    assert_no_server_errors(standin_proxy, 1)


@pytest.mark.kafka
async def test_tool_session_against_standin(standin_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    # max_tokens covers the longest forced text: the stand-in samples one token per byte.
    run = await run_claude(standin_proxy, tmp_path, tool_script, max_tokens=512, seed=7)
    assert_finished(run)
    assert_calls_recorded(run)
    assert_tool_round_trips(run)
    assert_prefix_chain(run)
    assert_no_server_errors(standin_proxy, run.script.calls)
    assert_wire_matches_fixtures(run)


@pytest.fixture
def vllm_proxy(kafka: KafkaSettings, vllm_url: str) -> Iterator[ProxyUnderTest]:
    with serve(create_app(proxy_settings(vllm_url, record_request_body=True, engine_timeout_s=300), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


@pytest.mark.kafka
async def test_tool_session_against_real_vllm(vllm_proxy: ProxyUnderTest, vllm_url: str, tmp_path: Path) -> None:
    """The same session on the real engine: guided decoding forces the text, vLLM's hermes parser turns
    the <tool_call> blocks into tool calls, Claude Code runs them."""
    run = await run_claude(vllm_proxy, tmp_path, tool_script, max_tokens=256, seed=11)
    assert_finished(run)
    assert_calls_recorded(run)
    assert_tool_round_trips(run)
    assert_prompt_text_chain(run, vllm_url)
    assert_no_server_errors(vllm_proxy, run.script.calls)
