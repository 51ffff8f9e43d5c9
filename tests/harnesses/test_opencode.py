"""opencode (npm ``opencode-ai``, pinned in ``producers.harness_install``) run headless through the proxy
against the stand-in engine, on both of the OpenAI APIs it can speak.

opencode is configured with a custom provider in its global config (a fresh HOME/XDG tree): npm
``@ai-sdk/openai-compatible`` speaks Chat Completions (``/v1/chat/completions``), npm ``@ai-sdk/openai``
speaks Responses (``/v1/responses``, ``store: false``, the whole history as input items). ``opencode run
--format json`` prints one JSON event a line (``text``, ``tool_use``, ``step_finish``, ``error``). Model
listing, auto-update, sharing and LSP downloads are off and the CLI runs with only loopback
(``tests.harnesses.isolation``), so a finished run needed nothing but the proxy.

What opencode sends, per ``opencode run`` of a new session: a title call first (no tools, system prompt
"You are a title generator", the prompt as a second user message; its first line becomes the session's
title) and then the agent's own calls (its system prompt and ten tools: bash, edit, glob, grep, read,
skill, task, todowrite, webfetch, write; ``tool_choice: auto``), every one streamed. The session's
``engine.turns`` script the model by the number of assistant messages in the prompt, so the title call
gets turn 0's text as the agent's first call does.

The sessions:

- text only (both APIs): the title call and one agent call, both forced to a short text; the title in
  opencode's own session export is that text;
- a scripted tool session (both APIs, on a stand-in with vLLM's token endpoints, so the proxy continues
  the agent's calls exactly): turn 0 calls opencode's ``write`` tool (the file appears in the workspace),
  turn 1 answers in text, then ``opencode run --continue`` adds a user turn answered by turn 2; each
  agent call extends the previous one's prompt + sampled ids token for token;
- the same tool session on the plain stand-in (no token endpoints: every prompt rendered whole);
- the recorded request bodies (``tests/fixtures/harnesses/opencode/<api>/call_<n>.json``, rewritten from
  the exact tool session with ``ROLLWIRE_RECORD_OPENCODE=1``, paths normalized) parse the way the live run
  did, so an opencode upgrade that changes its wire shows here;
- roles: the title call, made before the agent's first call, must not turn the agent's own line into a
  ``sub_agent`` branch.

Every call is recorded with token ids, and the proxy answered every one 200.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from producers.harness_install import ensure_harness
from proxy.continuation.equivalence import content_text
from proxy.apis.openai_chat import ChatCompletionsApi
from proxy.apis.openai_responses import ResponsesApi
from proxy.apis.base import Route
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.harnesses.common import (
    SessionRun,
    ToolStep,
    assert_calls_recorded,
    assert_exact_continuations,
    assert_no_server_errors,
    assert_prefix_chain,
    clean_env,
    forced_turn,
    make_dirs,
    run_on_session,
    serve_proxy,
)
from tests.harnesses.isolation import run_harness
from tests.proxy.conftest import ProxyUnderTest
from tests.proxy.conftest import standin_url  # noqa: F401  (the plain stand-in engine fixture, module-scoped)
from tests.servers import serve

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "opencode"
MODEL = "qwen3-coder"
PROVIDER = "rollwire"
TITLE_PROMPT = "You are a title generator."
AGENT_PROMPT = "You are opencode"
AGENT_TOOLS = {"bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write"}
HELLO = "Hello from opencode."
FILE_NAME, FILE_TEXT = "notes.txt", "alpha\n"
ANSWER = "notes.txt now holds alpha."
FOLLOW_UP_ANSWER = "Nothing else to do."
INSTRUCTION = "Create notes.txt with the line alpha."
FOLLOW_UP = "Anything else?"


@dataclass(frozen=True)
class Api:
    """One of opencode's OpenAI providers: its npm package and the proxy's name for the API it speaks."""

    name: str
    npm: str
    api: str


CHAT = Api("chat", "@ai-sdk/openai-compatible", "openai.chat")
RESPONSES = Api("responses", "@ai-sdk/openai", "openai.responses")
APIS = [pytest.param(CHAT, id="chat"), pytest.param(RESPONSES, id="responses")]


@pytest.fixture(scope="module")
def token_standin_url() -> Iterator[str]:
    """A stand-in that also serves vLLM's token endpoints (render, generate, derender): exact continuation."""
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16, token_api=True))) as url:
        yield url


@pytest.fixture
def plain_proxy(kafka: KafkaSettings, standin_url: str) -> Iterator[ProxyUnderTest]:  # noqa: F811
    with serve_proxy(standin_url, kafka, record_request_body=True) as proxy:
        yield proxy


@pytest.fixture
def exact_proxy(kafka: KafkaSettings, token_standin_url: str) -> Iterator[ProxyUnderTest]:
    with serve_proxy(token_standin_url, kafka, record_request_body=True) as proxy:
        yield proxy


# -- running opencode --------------------------------------------------------------------------------

def configure(home: Path, session: dict[str, Any], api: Api) -> dict[str, str]:
    """opencode's global config under a fresh HOME (the session's provider as its model and small model);
    returns the environment to run it with."""
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    (config / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "model": f"{PROVIDER}/{MODEL}", "small_model": f"{PROVIDER}/{MODEL}",
        "provider": {PROVIDER: {"npm": api.npm, "name": PROVIDER,
                                "options": {"baseURL": session["base_urls"]["openai"], "apiKey": session["api_key"]},
                                "models": {MODEL: {"name": MODEL}}}}}, indent=1))
    env = clean_env("OPENCODE_", "XDG_")
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local" / "share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local" / "state"),
               OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_SHARE="1",
               OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1")
    return env


@dataclass
class OpencodeRun(SessionRun):
    """An opencode run on a proxy session: the JSON lines it printed, and its environment (for a next run)."""

    api: Api
    cli_env: dict[str, str]

    @property
    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    @property
    def texts(self) -> list[str]:
        return [line["part"]["text"] for line in self.lines if line["type"] == "text"]

    @property
    def session_id(self) -> str:
        """opencode's own session id (``ses_...``)."""
        return str(self.lines[0]["sessionID"])


async def run_opencode(proxy: ProxyUnderTest, session: dict[str, Any], api: Api, home: Path, workspace: Path,
                       message: str, *, again: bool = False) -> OpencodeRun:
    """``opencode run --format json MESSAGE`` in ``workspace`` (``again``: ``--continue`` its last session)."""
    env = configure(home, session, api)
    command = [str(ensure_harness("opencode")), "run", "--format", "json", "--print-logs", "--log-level", "WARN",
               *(["--continue"] if again else []), message]
    return await run_on_session(proxy, session, command, home=home, workspace=workspace, env=env, timeout_s=300,
                                run_type=OpencodeRun, api=api, cli_env=env)


def exported_title(run: OpencodeRun, proxy: ProxyUnderTest) -> str:
    """The title opencode stored for its session (``opencode export``: read from its database)."""
    result = run_harness([str(ensure_harness("opencode")), "export", run.session_id], cwd=run.workspace,
                         env=run.cli_env, proxy_url=proxy.url, timeout_s=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return str(json.loads(result.stdout[result.stdout.index("{"):])["info"]["title"])


# -- what every run must show ------------------------------------------------------------------------

def assert_finished(run: OpencodeRun) -> None:
    """Exit 0, no error event, every step finished for a reason the model gave (not an error or abort)."""
    shown = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, shown
    assert not [line for line in run.lines if line["type"] == "error"], shown
    assert "level=ERROR" not in run.stderr, run.stderr[-3000:]
    reasons = [line["part"]["reason"] for line in run.lines if line["type"] == "step_finish"]
    assert reasons and set(reasons) <= {"stop", "tool-calls"}, reasons


def is_title_call(event: Completion) -> bool:
    system = event.request.messages[0]
    return not event.request.tools and system.role in ("system", "developer") and \
        (content_text(system) or "").startswith(TITLE_PROMPT)


def split_calls(run: OpencodeRun) -> tuple[list[Completion], list[Completion]]:
    """The run's title calls and agent calls, each in call order; nothing else."""
    titles = [e for e in run.events if is_title_call(e)]
    agent = [e for e in run.events if not is_title_call(e)]
    for event in agent:
        assert {t.name for t in event.request.tools} == AGENT_TOOLS, [t.name for t in event.request.tools]
        assert (content_text(event.request.messages[0]) or "").startswith(AGENT_PROMPT)
    return titles, agent


def assert_title_call(title: Completion, run: OpencodeRun, proxy: ProxyUnderTest, expected_reply: str) -> None:
    """The title call was answered (text, no tool calls) and opencode took its first line as the title.
    opencode sends it beside the agent's first call: the two are numbered in the order their claims reach
    the log, so the title call is either of the session's first two."""
    assert title.sequence in (0, 1) and title.request.stream
    assert title.message is not None and title.message.content == expected_reply and not title.message.tool_calls
    assert exported_title(run, proxy) == expected_reply.splitlines()[0]


def assert_agent_chain(run: OpencodeRun, agent: list[Completion], *, exact: bool) -> None:
    """The agent's calls are one branch: each extends the previous call's prompt + sampled ids token for
    token, continued exactly by the proxy when the engine has the token endpoints."""
    assert_prefix_chain(dataclasses.replace(run, events=agent))
    assert_exact_continuations(run.events)
    first, *later = agent
    assert first.continuation is not None and first.continuation.parent_sequence is None
    for parent, event in zip(agent, later):
        continuation = event.continuation
        assert continuation is not None and continuation.branch == first.continuation.branch
        assert continuation.parent_sequence == parent.sequence
        if exact:
            assert continuation.mode == "exact" and continuation.opened is None, continuation
        else:
            assert continuation.opened == "engine_has_no_token_api", continuation


# -- the sessions ------------------------------------------------------------------------------------

@pytest.mark.kafka
@pytest.mark.parametrize("api", APIS)
async def test_text_session(api: Api, plain_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    home, workspace = make_dirs(tmp_path)
    session = plain_proxy.new_session(engine={"max_tokens": 64, "seed": 3, "turns": [forced_turn(HELLO)]})
    run = await run_opencode(plain_proxy, session, api, home, workspace, "say hello")
    assert_finished(run)
    assert run.texts == [HELLO]
    assert_calls_recorded(run, api.api, 2, min_prompt_tokens=100)
    assert_no_server_errors(plain_proxy, api.api, 2)
    [title], [agent] = split_calls(run)
    assert_title_call(title, run, plain_proxy, HELLO)
    assert agent.message is not None and agent.message.content == HELLO and agent.finish_reason == "stop"
    assert [m.role for m in agent.request.messages[1:]] == ["user"]
    for event in run.events:
        assert event.request_body is not None
        body = json.loads(event.request_body)
        assert body["stream"] is True and body["model"] == MODEL
        if api is RESPONSES:
            assert body["store"] is False and "previous_response_id" not in body
        else:
            assert body["stream_options"] == {"include_usage": True}


def tool_turns(workspace: Path) -> list[dict[str, Any]]:
    """Turn 0 writes the file with opencode's write tool (an absolute path), turn 1 answers, turn 2 (the
    follow-up's) answers again."""
    write = ToolStep("write", {"filePath": str(workspace / FILE_NAME), "content": FILE_TEXT})
    return [forced_turn(write.text()), forced_turn(ANSWER), forced_turn(FOLLOW_UP_ANSWER)]


async def run_tool_session(proxy: ProxyUnderTest, api: Api, tmp_path: Path) -> tuple[OpencodeRun, OpencodeRun]:
    home, workspace = make_dirs(tmp_path)
    # max_tokens covers the longest forced text: the stand-in samples one token per byte.
    session = proxy.new_session(engine={"max_tokens": 512, "seed": 7, "turns": tool_turns(workspace)})
    first = await run_opencode(proxy, session, api, home, workspace, INSTRUCTION)
    assert_finished(first)
    assert (workspace / FILE_NAME).read_text() == FILE_TEXT, first.stdout[-3000:]
    assert first.texts == [ANSWER]
    [tool] = [line["part"] for line in first.lines if line["type"] == "tool_use"]
    assert tool["tool"] == "write" and tool["state"]["status"] == "completed", tool
    second = await run_opencode(proxy, session, api, home, workspace, FOLLOW_UP, again=True)
    assert_finished(second)
    assert second.texts == [FOLLOW_UP_ANSWER] and second.session_id == first.session_id
    return first, second


def assert_tool_session(first: OpencodeRun, second: OpencodeRun, proxy: ProxyUnderTest, *, exact: bool) -> None:
    api = first.api
    # The first run: the title call and two agent calls; the follow-up: one agent call (the title is set).
    assert_calls_recorded(second, api.api, 4, min_prompt_tokens=100)
    assert_no_server_errors(proxy, api.api, 4)
    for event in second.events:
        assert event.request_body is not None and json.loads(event.request_body)["stream"] is True
    [title], agent = split_calls(second)
    assert_title_call(title, second, proxy, tool_turns(second.workspace)[0]["vllm_xargs"]["rollwire_forced_text"])
    assert_agent_chain(second, agent, exact=exact)
    call_turn, answer_turn, follow_up_turn = agent
    # Turn 0: the write call, parsed from the model's <tool_call> block.
    assert call_turn.finish_reason == "tool_calls" and call_turn.message is not None
    [call] = call_turn.message.tool_calls
    assert call.name == "write"
    assert json.loads(call.arguments) == {"filePath": str(second.workspace / FILE_NAME), "content": FILE_TEXT}
    # Turn 1: opencode sent the call back (same id, arguments re-serialized) and its result.
    assert [m.role for m in answer_turn.request.messages] == ["system", "user", "assistant", "tool"]
    assistant, result = answer_turn.request.messages[2:]
    [echoed] = assistant.tool_calls
    assert echoed.id == call.id and json.loads(echoed.arguments) == json.loads(call.arguments)
    assert result.tool_call_id == call.id and result.content and not result.is_error
    assert answer_turn.finish_reason == "stop" and answer_turn.message is not None
    assert answer_turn.message.content == ANSWER
    # The follow-up (another process, the history read back from opencode's database): only a user turn added.
    assert follow_up_turn.request.messages[:4] == answer_turn.request.messages
    assert [m.role for m in follow_up_turn.request.messages[4:]] == ["assistant", "user"]
    assert content_text(follow_up_turn.request.messages[4]) == ANSWER
    assert FOLLOW_UP in (content_text(follow_up_turn.request.messages[5]) or "")
    assert follow_up_turn.message is not None and follow_up_turn.message.content == FOLLOW_UP_ANSWER


@pytest.mark.kafka
@pytest.mark.parametrize("api", APIS)
async def test_tool_session_continued_exactly(api: Api, exact_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    first, second = await run_tool_session(exact_proxy, api, tmp_path)
    assert_tool_session(first, second, exact_proxy, exact=True)
    if os.environ.get("ROLLWIRE_RECORD_OPENCODE") == "1":
        record_fixtures(second)


@pytest.mark.kafka
async def test_tool_session_rendered(plain_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    first, second = await run_tool_session(plain_proxy, CHAT, tmp_path)
    assert_tool_session(first, second, plain_proxy, exact=False)


@pytest.mark.kafka
async def test_title_call_does_not_make_the_agent_a_sub_agent(exact_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    """opencode asks for the title before its agent's first call: a call without tools that opens the
    session's first branch. The agent's own calls (tools, another system prompt) are still the session's
    main line, not a sub-agent: a sub-agent is one the agent started, while the main line is there."""
    home, workspace = make_dirs(tmp_path)
    session = exact_proxy.new_session(engine={"max_tokens": 64, "seed": 3, "turns": [forced_turn(HELLO)]})
    run = await run_opencode(exact_proxy, session, CHAT, home, workspace, "say hello")
    assert_finished(run)
    [title], [agent] = split_calls(run)
    assert title.sequence < agent.sequence
    assert agent.continuation is not None and agent.continuation.role == "main", agent.continuation


# -- the recorded wire -------------------------------------------------------------------------------

WORKSPACE, HOME = "/workspace", "/home/opencode"


def record_fixtures(run: OpencodeRun) -> None:
    """The session's request bodies, in call order, workspace and HOME paths normalized."""
    folder = FIXTURES / run.api.name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("call_*.json"):
        old.unlink()
    for event in run.events:
        assert event.request_body is not None
        body = event.request_body.replace(str(run.workspace), WORKSPACE).replace(str(run.home), HOME)
        (folder / f"call_{event.sequence}.json").write_text(
            json.dumps(json.loads(body), indent=1, ensure_ascii=False) + "\n")


@pytest.mark.parametrize("api", APIS)
def test_recorded_bodies_parse(api: Api) -> None:
    """opencode 1.18.33's bodies, as recorded: a title call, then the agent's three calls (the write call, its
    answer, the follow-up), each normalized the way the live run's were."""
    paths = sorted(FIXTURES.joinpath(api.name).glob("call_*.json"))
    assert len(paths) == 4, "re-record: ROLLWIRE_RECORD_OPENCODE=1 pytest tests/harnesses/test_opencode.py"
    bodies = [json.loads(path.read_text()) for path in paths]
    parser = ChatCompletionsApi() if api is CHAT else ResponsesApi()
    title, write, answer, follow_up = (parser.parse(body, Route()).request for body in bodies)
    for body in bodies:
        assert body["model"] == MODEL and body["stream"] is True
        assert ("store" in body and body["store"] is False) if api is RESPONSES else \
            body["stream_options"] == {"include_usage": True}
    # The title call: no tools, the title prompt, the user's message again as a second user message.
    assert not title.tools and [m.role for m in title.messages] == ["system", "user", "user"]
    assert (content_text(title.messages[0]) or "").startswith(TITLE_PROMPT)
    assert INSTRUCTION in (content_text(title.messages[2]) or "")
    # The agent: its system prompt (naming the workspace) and its ten tools, the same on every call.
    assert {t.name for t in write.tools} == AGENT_TOOLS and write.tools == answer.tools == follow_up.tools
    assert all(t.parameters and t.parameters["type"] == "object" for t in write.tools)
    assert WORKSPACE in (content_text(write.messages[0]) or "")
    assert [m.role for m in write.messages] == ["system", "user"]
    assert answer.messages[:2] == write.messages and follow_up.messages[:4] == answer.messages
    assistant, result = answer.messages[2:]
    [call] = assistant.tool_calls
    assert call.name == "write" and json.loads(call.arguments) == {"filePath": f"{WORKSPACE}/{FILE_NAME}",
                                                                   "content": FILE_TEXT}
    assert result.role == "tool" and result.tool_call_id == call.id and result.content
    assert [m.role for m in follow_up.messages[4:]] == ["assistant", "user"]
    assert content_text(follow_up.messages[4]) == ANSWER
    # opencode quotes a message holding spaces ("...") before sending it.
    assert content_text(follow_up.messages[5]) == f'"{FOLLOW_UP}"'
    if api is CHAT:  # the call comes back with empty text beside it, its arguments re-serialized
        wire = bodies[2]["messages"][2]
        assert wire["content"] == "" and wire["tool_calls"][0]["function"]["arguments"] == json.dumps(
            json.loads(call.arguments), separators=(",", ":"), ensure_ascii=False)
    else:  # store: false, so the whole history as input items: no previous_response_id, no item references
        kinds = [item.get("type", "message") for item in bodies[2]["input"]]
        assert kinds == ["message", "message", "function_call", "function_call_output"]
        assert all("previous_response_id" not in body for body in bodies)
        assert bodies[1]["prompt_cache_key"] == bodies[3]["prompt_cache_key"] and "prompt_cache_key" not in bodies[0]
