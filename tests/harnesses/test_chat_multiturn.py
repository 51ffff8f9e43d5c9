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
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from producers.harness_install import ensure_harness
from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.harnesses.isolation import run_harness
from tests.proxy.conftest import ProxyUnderTest, proxy_settings
from tests.proxy.conftest import standin_url  # noqa: F401  (the stand-in engine fixture, module-scoped)
from tests.servers import serve

pytestmark = pytest.mark.kafka

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses"
MODEL = "qwen3-coder"
INSTRUCTION = "Create notes.txt with the line alpha, then append the line beta, then say what you did."


# -- scripted model output ---------------------------------------------------------------------------

_REGEX_SPECIALS = set(".^$*+?()[]{}|\\/")


def literal_regex(text: str) -> str:
    """A regex that matches exactly ``text``: metacharacters escaped, newlines as ``\\n``. Both engines
    read it as a literal (the stand-in replies with it verbatim; vLLM's guided decoding forces it)."""
    out = []
    for ch in text:
        if ch in _REGEX_SPECIALS:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        else:
            out.append(ch)
    return "".join(out)


@dataclass(frozen=True)
class ToolStep:
    name: str
    arguments: dict[str, Any]

    def text(self) -> str:
        """The hermes block the model is forced to write, laid out as the chat template renders a tool call.

        Both CLIs parse the arguments they get and echo them back through ``JSON.stringify`` (no spaces; see
        the fixtures), so the argument text of the next request is theirs, not the model's. vLLM parses
        echoed arguments into an object and the template re-serializes them with ``json.dumps``'s default
        separators (the stand-in does the same): written in that layout, the model's text comes back
        unchanged in the next prompt."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return f'<tool_call>\n{{"name": "{self.name}", "arguments": {arguments}}}\n</tool_call>'


@dataclass(frozen=True)
class Script:
    """What the model says, turn by turn: tool calls, then a final answer; and what the workspace holds then."""

    steps: tuple[ToolStep, ...]
    answer: str
    expected_files: dict[str, str]

    @property
    def calls(self) -> int:
        return len(self.steps) + 1

    def turns(self) -> list[dict[str, Any]]:
        texts = [step.text() for step in self.steps] + [self.answer]
        return [{"structured_outputs": {"regex": literal_regex(text)}} for text in texts]


def qwen_script(workspace: Path) -> Script:
    # write_file wants an absolute path; run_shell_command runs in the project root (the cwd).
    return Script(steps=(ToolStep("write_file", {"file_path": str(workspace / "notes.txt"), "content": "alpha\n"}),
                         ToolStep("run_shell_command", {"command": "echo beta >> notes.txt",
                                                        "description": "Append beta to notes.txt"})),
                  answer="notes.txt now holds alpha and beta.", expected_files={"notes.txt": "alpha\nbeta\n"})


def pi_script(workspace: Path) -> Script:
    # Pi resolves relative paths against its cwd; its edit tool takes a list of exact replacements.
    return Script(steps=(ToolStep("bash", {"command": "printf 'alpha\\n' > notes.txt"}),
                         ToolStep("edit", {"path": "notes.txt",
                                           "edits": [{"oldText": "alpha", "newText": "alpha\nbeta"}]})),
                  answer="notes.txt now holds alpha and beta.", expected_files={"notes.txt": "alpha\nbeta\n"})


# -- the CLIs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatCli:
    """How to run one CLI headless against a proxy session: files it needs in HOME, command line, env."""

    name: str
    script: Callable[[Path], Script]
    configure: Callable[[Path, dict[str, Any]], tuple[list[str], dict[str, str]]]


def _configure_qwen(home: Path, session: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}}, "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False}, "general": {"enableAutoUpdate": False},
        "memory": {"enableManagedAutoMemory": False}, "model": {"name": MODEL}}))
    return ([str(ensure_harness("qwen-code")), "--yolo", "-o", "json", INSTRUCTION],
            {"OPENAI_BASE_URL": session["base_urls"]["openai"], "OPENAI_API_KEY": session["api_key"],
             "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"})


def _configure_pi(home: Path, session: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    # A reasoning model, unlike the text-only test's: Pi then sends its system prompt as a `developer`
    # message and adds `reasoning_effort`, so the fixtures cover that wire too.
    (home / ".pi" / "agent").mkdir(parents=True)
    (home / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"rollwire": {
        "baseUrl": session["base_urls"]["openai"], "api": "openai-completions", "apiKey": session["api_key"],
        "models": [{"id": MODEL, "reasoning": True, "contextWindow": 32768, "maxTokens": 4096}]}}}))
    return ([str(ensure_harness("pi")), "-p", "--provider", "rollwire", "--model", MODEL, "--no-session",
             INSTRUCTION], {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"})


QWEN = ChatCli("qwen-code", qwen_script, _configure_qwen)
PI = ChatCli("pi", pi_script, _configure_pi)


@dataclass
class SessionRun:
    cli: ChatCli
    script: Script
    session: dict[str, Any]
    home: Path
    workspace: Path
    returncode: int
    stdout: str
    stderr: str
    events: list[Completion]
    session_calls: int


async def run_scripted_session(proxy: ProxyUnderTest, cli: ChatCli, root: Path, *, max_tokens: int,
                               seed: int) -> SessionRun:
    """Run ``cli`` once in ``root/workspace`` (HOME ``root/home``) on a session scripted by its Script."""
    home, workspace = root / "home", root / "workspace"
    home.mkdir(parents=True)
    workspace.mkdir(parents=True)
    script = cli.script(workspace)
    session = proxy.new_session(engine={"max_tokens": max_tokens, "seed": seed, "turns": script.turns()})
    command, env = cli.configure(home, session)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "ROLLWIRE_", "PI_"))}
    result = run_harness(command, cwd=workspace, env={**base, "HOME": str(home), **env}, proxy_url=proxy.url)
    calls = httpx.get(f"{proxy.url}/v1/sessions/{session['session_id']}", timeout=30).json()["calls"]
    events = [e for e in await proxy.completions(calls) if e.session_id == session["session_id"]]
    return SessionRun(cli, script, session, home, workspace, result.returncode, result.stdout, result.stderr,
                      events, calls)


# -- what every scripted session must show -----------------------------------------------------------

def assert_cli_finished(run: SessionRun) -> None:
    """Exit 0, the files the tools were told to write, and the final answer in the CLI's output."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "API Error" not in run.stdout, run.stdout[-3000:]
    for name, content in run.script.expected_files.items():
        path = run.workspace / name
        assert path.is_file(), f"{run.cli.name} did not run its tools: no {name}\n{run.stdout[-3000:]}"
        assert path.read_text() == content
    assert run.script.answer in run.stdout


def assert_client_saw_no_errors(run: SessionRun) -> None:
    """Qwen Code's own account (``-o json``): as many API requests as scripted turns, none failed. A stream
    without a finish_reason would show up here as retried requests (it retries twice, then gives up
    silently with exit 0). Pi's ``-p`` prints only the answer, checked by assert_cli_finished."""
    if run.cli is not QWEN:
        return
    result = next(item for item in json.loads(run.stdout) if item.get("type") == "result")
    assert result["is_error"] is False and result["result"] == run.script.answer
    api = result["stats"]["models"][MODEL]["api"]
    assert (api["totalRequests"], api["totalErrors"]) == (run.script.calls, 0), api


def assert_calls_recorded(run: SessionRun) -> None:
    """One ok completion event per scripted turn, each with token ids and one logprob per sampled token;
    no extra call (a retry, a side call) and no retry marker."""
    events = sorted(run.events, key=lambda e: e.sequence)
    assert run.session_calls == run.script.calls, [e.request.messages[-1] for e in events]
    assert [e.sequence for e in events] == list(range(run.script.calls))
    for event in events:
        assert event.status == "ok", event.error
        assert event.api == "openai.chat"
        assert event.retry_count == 0 and event.retry_of is None
        assert event.request_body is not None
        assert event.prompt_token_ids is not None and len(event.prompt_token_ids) > 100
        assert event.token_ids is not None and len(event.token_ids) > 0
        assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)


def assert_tool_round_trips(run: SessionRun) -> None:
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


def assert_prefix_chain(run: SessionRun) -> None:
    """Call k+1's prompt starts with call k's prompt followed by the tokens call k sampled: the CLIs keep
    their history append-only, and the scripted text is laid out as the template writes it back (see
    ToolStep.text). Holds token for token where the engine tokenizes as it samples (the stand-in)."""
    events = sorted(run.events, key=lambda e: e.sequence)
    for earlier, later in zip(events, events[1:]):
        head = earlier.prompt_token_ids.tolist() + earlier.token_ids.tolist()
        prompt = later.prompt_token_ids.tolist()
        differs = next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b), min(len(head), len(prompt)))
        assert len(prompt) > len(head) and differs == len(head), (
            f"call {later.sequence} does not extend call {earlier.sequence} (+ its {len(earlier.token_ids)} sampled "
            f"tokens, {len(head)} in all): first difference at token {differs}")


_END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


def assert_prompt_text_chain(run: SessionRun, engine_url: str) -> None:
    """On the real engine: call k+1's prompt starts with call k's prompt token for token (the CLI's history
    is append-only), and the text that follows it starts with the text call k sampled.

    The sampled tokens themselves are not repeated: the model wrote ``<tool_call>`` as ordinary text
    pieces (guided decoding lets it), where the template writes the one special token; the JSON's BPE
    pieces can differ as well, and the turn may end on ``<|endoftext|>`` where the template writes
    ``<|im_end|>``. That is the engine re-tokenizing text, not the CLI rewriting its history; it is why a
    trajectory keeps the sampled ids of each call rather than re-tokenizing the next prompt."""
    events = sorted(run.events, key=lambda e: e.sequence)
    for earlier, later in zip(events, events[1:]):
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
    """The proxy's own counters: every model call answered 200, none 5xx."""
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=30).text
    answered = {m.group(1): float(m.group(2)) for m in
                re.finditer(r'^rollwire_proxy_requests_total\{api="openai\.chat",status="(\d+)"\} (\S+)$', metrics,
                            re.M)}
    assert answered == {"200": float(calls)}, answered


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


def assert_wire_matches_fixtures(run: SessionRun) -> None:
    recorded = fixture_bodies(run.cli.name)
    assert len(recorded) == run.script.calls, "re-record: python tests/fixtures/harnesses/record_chat.py"
    for event, body in zip(sorted(run.events, key=lambda e: e.sequence), recorded):
        live = json.loads(event.request_body)
        assert wire_shape(live) == wire_shape(body), (
            f"{run.cli.name} call {event.sequence} changed its wire format; re-record the fixtures "
            f"(tests/fixtures/harnesses/record_chat.py) and check tests/proxy/test_chat_wire_fixtures.py")


# -- the sessions ------------------------------------------------------------------------------------

@pytest.fixture
def standin_proxy(kafka: KafkaSettings, standin_url: str) -> Iterator[ProxyUnderTest]:
    with serve(create_app(proxy_settings(standin_url, record_request_body=True), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


@pytest.mark.parametrize("cli", [QWEN, PI], ids=lambda cli: cli.name)
async def test_scripted_tool_session_against_standin(cli: ChatCli, standin_proxy: ProxyUnderTest,
                                                     tmp_path: Path) -> None:
    # max_tokens covers the longest forced text: the stand-in samples one token per byte.
    run = await run_scripted_session(standin_proxy, cli, tmp_path, max_tokens=512, seed=7)
    assert_cli_finished(run)
    assert_client_saw_no_errors(run)
    assert_calls_recorded(run)
    assert_tool_round_trips(run)
    assert_prefix_chain(run)
    assert_no_server_errors(standin_proxy, run.script.calls)
    assert_wire_matches_fixtures(run)


@pytest.fixture
def vllm_proxy(kafka: KafkaSettings, vllm_url: str) -> Iterator[ProxyUnderTest]:
    with serve(create_app(proxy_settings(vllm_url, record_request_body=True, engine_timeout_s=300), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


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
    assert_no_server_errors(vllm_proxy, run.script.calls)
