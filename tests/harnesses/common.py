"""What the harness tests (and the re-record scripts beside their fixtures) share.

A scripted session: the model's output is forced turn by turn through the session's ``engine.turns``
(see ``Script`` and ``forced_turn``): on the real vLLM engine by token ids (``vllm_xargs.
rollwire_forced_tokens``, read by the engine's ``rollwire_forced_tokens`` logits processor: the ids the
chat template renders for the turn, ``<tool_call>`` and ``<|im_end|>`` as their special tokens), on the
stand-in by the same turn's text (``vllm_xargs.rollwire_forced_text``). The CLI runs with a throwaway
HOME and only loopback (``tests.harnesses.isolation``); ``run_on_session`` runs it and collects the
session's completion events. The checks every CLI's session must pass, whatever its API, are here too:
the calls recorded with token ids, the prompt chain (token for token, on both engines), no 5xx from the
proxy. Each test module keeps what is its CLI's own: its config files, command line, scripts and wire
format. ``literal_regex`` stays for tests that force text through guided decoding.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.support.standin_engine import FORCED_TEXT_ARG, StandinConfig, create_app as create_standin
from deploy.engine.plugins import FORCED_TOKENS_ARG
from deploy.engine.server import EngineConfig
from deploy.engine.tiny_model import build_tiny_model
from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from schemas.transport.admin import ensure_topics
from tests.harnesses.isolation import run_harness
from tests.proxy.conftest import ProxyUnderTest, proxy_settings
from tests.servers import serve

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


END_OF_TURN = "<|im_end|>"  # what the chat template writes after an assistant turn (the model's EOS)


@lru_cache(maxsize=1)
def _tiny_tokenizer() -> Any:
    """The tiny model's tokenizer (``tokenizers.Tokenizer``), from its model directory (built if missing)."""
    from tokenizers import Tokenizer

    config = EngineConfig.from_env()
    return Tokenizer.from_file(str(build_tiny_model(config.model_dir, seed=config.seed) / "tokenizer.json"))


def turn_token_ids(text: str) -> list[int]:
    """The ids the chat template renders for an assistant turn saying ``text``, up to and with its
    ``<|im_end|>``: added tokens (``<tool_call>``, ``</tool_call>``) as their own ids, the text between
    them as the tokenizer splits it. Added tokens cut the template's output into pieces tokenized apart,
    and the turn's text starts a piece (after ``<|im_start|>assistant\n``'s newline, which the Qwen2 split
    keeps apart from a following letter), so these are the ids the next prompt holds for this turn."""
    return list(_tiny_tokenizer().encode(text + END_OF_TURN, add_special_tokens=False).ids)


def forced_turn(text: str) -> dict[str, Any]:
    """One ``engine.turns`` entry forcing the model to say ``text``: vLLM samples exactly its template ids
    (``rollwire_forced_tokens``, raw logprobs stay the model's own on an engine run with
    ``--logprobs-mode raw_logprobs``); the stand-in replies with the text (``rollwire_forced_text``)."""
    return {"vllm_xargs": {FORCED_TOKENS_ARG: turn_token_ids(text), FORCED_TEXT_ARG: text}}


@dataclass(frozen=True)
class ToolStep:
    """One scripted tool call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]

    def text(self) -> str:
        """The hermes block the model is forced to write, laid out as the chat template renders a tool call.

        The CLIs parse the arguments they get and echo them back in their own layout (Qwen Code and Pi
        through ``JSON.stringify``, no spaces; see the fixtures). vLLM parses echoed arguments into an
        object and the template re-serializes them with ``json.dumps``'s default separators (the stand-in
        and the proxy, for Claude Code's ``tool_use.input``, do the same): written in that layout, the
        model's turn comes back unchanged in the next prompt, token for token (``turn_token_ids``)."""
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

    def texts(self) -> list[str]:
        """Each turn's text: the tool calls' hermes blocks, then the answer."""
        return [step.text() for step in self.steps] + [self.answer]

    def turns(self) -> list[dict[str, Any]]:
        """The session's ``engine.turns``: each turn forced by its template token ids (``forced_turn``)."""
        return [forced_turn(text) for text in self.texts()]


def engine_forces_tokens(engine_url: str) -> bool:
    """Whether the vLLM server at ``engine_url`` loads the ``rollwire_forced_tokens`` logits processor
    (a server started before it existed ignores the field and samples freely)."""
    ids = turn_token_ids("ok")
    body = {"model": EngineConfig().served_model_name, "messages": [{"role": "user", "content": "Say ok."}],
            "max_tokens": len(ids) + 2, "return_token_ids": True, "vllm_xargs": {FORCED_TOKENS_ARG: ids}}
    response = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=120)
    return response.status_code == 200 and response.json()["choices"][0].get("token_ids") == ids


def require_token_forcing(engine_url: str) -> None:
    """Fail at once, saying what to do, when the engine cannot force a scripted session's turns."""
    if not engine_forces_tokens(engine_url):
        pytest.fail(f"the vLLM server at {engine_url} does not force vllm_xargs.{FORCED_TOKENS_ARG}: it was "
                    "started without deploy/engine/server.py's --logits-processors flag; restart it")


# -- proxies and topics ------------------------------------------------------------------------------

async def fresh_topics(bootstrap: str, stem: str, *, session_partitions: int = 4) -> KafkaSettings:
    """Settings for topics under a fresh prefix ``<stem><hex>.`` on ``bootstrap``, the topics created."""
    kafka = KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=f"{stem}{uuid.uuid4().hex[:8]}.",
                          session_partitions=session_partitions, task_partitions=2)
    await ensure_topics(kafka)
    return kafka


@contextmanager
def serve_proxy(engine_url: str, kafka: KafkaSettings, *, engine_transport: httpx.AsyncBaseTransport | None = None,
                **settings: Any) -> Iterator[ProxyUnderTest]:
    """A proxy on a real socket in front of ``engine_url``, with ``settings`` over the test defaults."""
    app = create_app(proxy_settings(engine_url, **settings), kafka, engine_transport=engine_transport)
    with serve(app) as url:
        yield ProxyUnderTest(url, kafka)


@contextmanager
def serve_standin_proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    """A stand-in engine of its own and a proxy in front of it that keeps request bodies."""
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16))) as engine_url, \
            serve_proxy(engine_url, kafka, record_request_body=True) as proxy:
        yield proxy


@pytest.fixture
def standin_proxy(kafka: KafkaSettings, standin_url: str) -> Iterator[ProxyUnderTest]:
    """A proxy that keeps request bodies, over the module's stand-in engine (``standin_url``)."""
    with serve_proxy(standin_url, kafka, record_request_body=True) as proxy:
        yield proxy


@pytest.fixture
def vllm_proxy(kafka: KafkaSettings, vllm_url: str) -> Iterator[ProxyUnderTest]:
    """A proxy that keeps request bodies, over the real vLLM CPU server (CPU-slow: long engine timeout);
    the server must force scripted turns by token ids (``require_token_forcing``)."""
    require_token_forcing(vllm_url)
    with serve_proxy(vllm_url, kafka, record_request_body=True, engine_timeout_s=300) as proxy:
        yield proxy


# -- running a CLI on a session ----------------------------------------------------------------------

_SECRET_PREFIXES = ("OPENAI_", "ANTHROPIC_", "ROLLWIRE_")


def clean_env(*prefixes: str) -> dict[str, str]:
    """This process's environment without provider and rollwire variables, nor those under ``prefixes``."""
    drop = _SECRET_PREFIXES + prefixes
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def make_dirs(root: Path) -> tuple[Path, Path]:
    """``root/home`` and ``root/workspace``, created."""
    home, workspace = root / "home", root / "workspace"
    home.mkdir(parents=True)
    workspace.mkdir(parents=True)
    return home, workspace


@dataclass
class SessionRun:
    """One CLI run on a proxy session: its exit and output, and the session's events in call order."""

    session: dict[str, Any]
    home: Path
    workspace: Path
    returncode: int
    stdout: str
    stderr: str
    events: list[Completion]
    session_calls: int


Run = TypeVar("Run", bound=SessionRun)


async def run_on_session(proxy: ProxyUnderTest, session: dict[str, Any], command: list[str], *, home: Path,
                         workspace: Path, env: dict[str, str], timeout_s: float = 600,
                         run_type: type[Run] = SessionRun, **fields: Any) -> Run:
    """Run ``command`` in ``workspace`` with only loopback, then collect the session's completion events
    (as many as the proxy counted calls). ``run_type`` and ``fields``: a SessionRun subclass and its own fields."""
    result = run_harness(command, cwd=workspace, env=env, proxy_url=proxy.url, timeout_s=timeout_s)
    calls = proxy.session_state(session["session_id"], session["api_key"])["calls"]
    events = [e for e in await proxy.completions(calls) if e.session_id == session["session_id"]] if calls else []
    return run_type(session=session, home=home, workspace=workspace, returncode=result.returncode,
                    stdout=result.stdout, stderr=result.stderr, events=sorted(events, key=lambda e: e.sequence),
                    session_calls=calls, **fields)


# -- what every session must show --------------------------------------------------------------------

def assert_files_written(run: SessionRun, script: Script, cli: str) -> None:
    """The files the scripted tools were told to write are in the workspace, with their content."""
    for name, content in script.expected_files.items():
        path = run.workspace / name
        assert path.is_file(), f"{cli} did not run its tools: no {name}\n{run.stdout[-3000:]}"
        assert path.read_text() == content


def assert_calls_recorded(run: SessionRun, api: str, calls: int, *, min_prompt_tokens: int) -> None:
    """One ok completion event on ``api`` per expected call, in sequence, each with token ids and one
    logprob per sampled token; no extra call (a retry, a side call) and no retry marker."""
    assert run.session_calls == calls, [e.request.messages[-1] for e in run.events]
    assert [e.sequence for e in run.events] == list(range(calls))
    for event in run.events:
        assert event.status == "ok", event.error
        assert event.api == api
        assert event.retry_count == 0 and event.retry_of is None
        assert event.prompt_token_ids is not None and len(event.prompt_token_ids) > min_prompt_tokens
        assert event.token_ids is not None and len(event.token_ids) > 0
        assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)


async def session_events(proxy: ProxyUnderTest, session_id: str, api: str, *,
                         timeout_s: float = 20.0) -> list[Completion]:
    """The session's completion events, in call order, after checking that there is at least one and
    each is ok, on ``api``, with token ids and one logprob per sampled token (unscripted sessions)."""
    calls = proxy.session_state(session_id)["calls"]
    assert calls >= 1
    events = [e for e in await proxy.completions(calls, timeout_s=timeout_s) if e.session_id == session_id]
    assert sorted(e.sequence for e in events) == list(range(calls))
    for event in events:
        assert event.status == "ok", event.error
        assert event.api == api
        assert len(event.prompt_token_ids) > 100 and len(event.token_ids) > 0
        assert len(event.logprobs) == len(event.token_ids)
    events = sorted(events, key=lambda e: e.sequence)
    assert_exact_continuations(events)
    return events


def assert_exact_continuations(events: list[Completion]) -> None:
    """Every call the proxy continued exactly extends its parent's prompt + sampled ids, token for token;
    every call that continues a branch (a parent) was continued exactly when its session is in exact mode."""
    by_sequence = {e.sequence: e for e in events}
    for event in events:
        continuation = event.continuation
        assert continuation is not None
        if continuation.parent_sequence is None or continuation.opened == "engine_has_no_token_api":
            continue  # a new branch, or an engine without the token endpoints (the stand-in by default)
        assert continuation.mode == "exact", (event.sequence, continuation)
        parent = by_sequence[continuation.parent_sequence]
        head = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()
        assert event.prompt_token_ids.tolist()[:len(head)] == head, (event.sequence, continuation)


def assert_prefix_chain(run: SessionRun, engine_url: str | None = None) -> None:
    """Call k+1's prompt starts with call k's prompt followed by the tokens call k sampled: the CLI keeps
    its history append-only, and the scripted turns are the template's own ids (``turn_token_ids``;
    the stand-in tokenizes as it samples). With ``engine_url`` (a vLLM server) a failure shows the texts."""
    events = sorted(run.events, key=lambda e: e.sequence)
    for earlier, later in zip(events, events[1:]):
        head = earlier.prompt_token_ids.tolist() + earlier.token_ids.tolist()
        prompt = later.prompt_token_ids.tolist()
        differs = next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b), min(len(head), len(prompt)))
        shown = ""
        if engine_url and differs < len(head):
            shown = (f"\nsampled: {_detokenize(engine_url, head[differs:])[:300]!r}"
                     f"\nprompt:  {_detokenize(engine_url, prompt[differs:differs + 200])[:300]!r}")
        assert len(prompt) > len(head) and differs == len(head), (
            f"call {later.sequence} does not extend call {earlier.sequence} (+ its {len(earlier.token_ids)} sampled "
            f"tokens, {len(head)} in all): first difference at token {differs}{shown}")


def assert_prompt_text_chain(run: SessionRun, engine_url: str) -> None:
    """On the real engine: call k+1's prompt extends call k's prompt plus the ids call k sampled, token for
    token (``assert_prefix_chain``), a failure shown as text. It held only for the text while turns were
    forced by a regex (the model wrote ``<tool_call>`` as ordinary text pieces); forced by token ids, the
    sampled ids are the template's own."""
    assert_prefix_chain(run, engine_url)


def _detokenize(engine_url: str, ids: list[int]) -> str:
    """The engine's text for ``ids`` (vLLM's ``/detokenize``)."""
    response = httpx.post(f"{engine_url}/detokenize", json={"tokens": ids}, timeout=60)
    response.raise_for_status()
    return str(response.json()["prompt"])


def assert_no_server_errors(proxy: ProxyUnderTest, api: str, calls: int) -> None:
    """The proxy's own counters for ``api``: every model call answered 200, none 5xx."""
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=30).text
    pattern = rf'^rollwire_proxy_requests_total\{{api="{re.escape(api)}",status="(\d+)"\}} (\S+)$'
    answered = {m.group(1): float(m.group(2)) for m in re.finditer(pattern, metrics, re.M)}
    assert answered == {"200": float(calls)}, answered


def assert_exit_ok(result: subprocess.CompletedProcess[str]) -> None:
    """The CLI exited 0 (else: the tail of its output)."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


class ReasoningEngine(httpx.AsyncBaseTransport):
    """The stand-in engine, but its streamed first turn (no assistant message yet) also carries reasoning
    text, as vLLM's reasoning parser would send it (a ``reasoning`` delta, no token ids of its own)."""

    def __init__(self, reasoning: str) -> None:
        self.reasoning = reasoning
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        response = await self._inner.handle_async_request(request)
        if request.url.path != "/v1/chat/completions":
            return response
        sent = json.loads(body)
        if not sent.get("stream") or any(m["role"] == "assistant" for m in sent["messages"]):
            return response
        first, rest = (await response.aread()).split(b"\n\n", 1)
        chunk = json.loads(first.removeprefix(b"data: "))
        chunk.update(prompt_token_ids=None, choices=[{"index": 0, "delta": {"reasoning": self.reasoning},
                                                      "finish_reason": None, "token_ids": [], "logprobs": None}])
        injected = first + b"\n\ndata: " + json.dumps(chunk).encode() + b"\n\n" + rest
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=injected)

    async def aclose(self) -> None:
        await self._inner.aclose()
