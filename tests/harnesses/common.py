"""What the harness tests (and the re-record scripts beside their fixtures) share.

A scripted session: the model's output is forced turn by turn through the session's ``engine.turns``
(``structured_outputs.regex`` literals, see ``literal_regex`` and ``Script``); the CLI runs with a
throwaway HOME and only loopback (``tests.harnesses.isolation``); ``run_on_session`` runs it and
collects the session's completion events. The checks every CLI's session must pass, whatever its API,
are here too: the calls recorded with token ids, the prompt chain (stand-in and real vLLM), no 5xx
from the proxy. Each test module keeps what is its CLI's own: its config files, command line, scripts
and wire format.
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
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from bench.standin_engine import StandinConfig, create_app as create_standin
from deploy.kafka import ensure_topics
from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import KafkaSettings
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
        model's text comes back unchanged in the next prompt."""
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
        """The session's ``engine.turns``: each turn's text forced as a literal."""
        texts = [step.text() for step in self.steps] + [self.answer]
        return [{"structured_outputs": {"regex": literal_regex(text)}} for text in texts]


# -- proxies and topics ------------------------------------------------------------------------------

async def fresh_topics(bootstrap: str, stem: str, *, session_partitions: int = 4) -> KafkaSettings:
    """Settings for topics under a fresh prefix ``<stem><hex>.`` on ``bootstrap``, the topics created."""
    kafka = KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=f"{stem}{uuid.uuid4().hex[:8]}.",
                          session_partitions=session_partitions, task_partitions=2)
    await ensure_topics(bootstrap, kafka.registry(), kafka.max_message_bytes)
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
    """A proxy that keeps request bodies, over the real vLLM CPU server (CPU-slow: long engine timeout)."""
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
    calls = httpx.get(f"{proxy.url}/v1/sessions/{session['session_id']}", timeout=30).json()["calls"]
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
    calls = httpx.get(f"{proxy.url}/v1/sessions/{session_id}", timeout=30).json()["calls"]
    assert calls >= 1
    events = [e for e in await proxy.completions(calls, timeout_s=timeout_s) if e.session_id == session_id]
    assert sorted(e.sequence for e in events) == list(range(calls))
    for event in events:
        assert event.status == "ok", event.error
        assert event.api == api
        assert len(event.prompt_token_ids) > 100 and len(event.token_ids) > 0
        assert len(event.logprobs) == len(event.token_ids)
    return sorted(events, key=lambda e: e.sequence)


def assert_prefix_chain(run: SessionRun) -> None:
    """Call k+1's prompt starts with call k's prompt followed by the tokens call k sampled: the CLI keeps
    its history append-only, and the scripted text is laid out as the template writes it back (see
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
    """The engine's text for ``ids`` (vLLM's ``/detokenize``)."""
    response = httpx.post(f"{engine_url}/detokenize", json={"tokens": ids}, timeout=60)
    response.raise_for_status()
    return response.json()["prompt"]


def assert_no_server_errors(proxy: ProxyUnderTest, api: str, calls: int) -> None:
    """The proxy's own counters for ``api``: every model call answered 200, none 5xx."""
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=30).text
    pattern = rf'^rollwire_proxy_requests_total\{{api="{re.escape(api)}",status="(\d+)"\}} (\S+)$'
    answered = {m.group(1): float(m.group(2)) for m in re.finditer(pattern, metrics, re.M)}
    assert answered == {"200": float(calls)}, answered


def assert_exit_ok(result: subprocess.CompletedProcess[str]) -> None:
    """The CLI exited 0 (else: the tail of its output)."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
