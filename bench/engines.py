"""Placement over a pool of real engines: prefix-cache reuse, load spread and failover, side by side.

Two (``--engines``) real vLLM CPU servers over the tiny model, started here by the routine behind ``rollwire
up --engines N`` (``deploy.stack.engines``, each in its own home under a temporary folder; ``--engine-urls``
reuses servers that are up instead), each bound to a core of its own (``--shared-core``: vLLM's automatic
binding, which puts every engine's worker on the first core). One ``rollwire proxy`` process in front of all of them per placement
policy, run in turn on the same engines; the policy is the proxy's ``ROLLWIRE_ENGINE_PLACEMENT`` (rollwire's
``sticky_least_loaded``, printed as ``placement``; ``round_robin``; ``consistent_hash``). Kafka: the broker at
``ROLLWIRE_KAFKA_BOOTSTRAP`` (else the project's local one, started if none answers), on a fresh topic prefix
deleted at the end.

The workload grows as an agent's prompt does: ``--sessions`` concurrent sessions (``POST /v1/sessions`` with the
admin token; exact-token continuation, replies cut at ``--max-tokens``) driven through
``/s/{id}/v1/chat/completions``, streamed. Every session starts from one shared system prompt, then its own long
context: a first user message of about ``--context-tokens`` tokens (its task and a file the agent read, unique to
the session); then ``--turns`` calls, each after the client echoed the reply and appended a tool result of about
``--result-tokens`` tokens. So each call's prompt extends the previous one, and the session's own prefix, not the
shared system prompt, is most of it: an engine that did not serve the session's last call has little of it
cached. Sizes are set in tokens through a characters-per-token ratio measured on the first engine's
``/tokenize``; the measured sizes are printed. Session ``i`` gets the same text under every policy.

Per policy, from the engines' own metrics (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``,
deltas over the run; every engine's cache is reset first with ``POST /reset_prefix_cache``): the prefix-cache
hit rate; the load spread, max ÷ mean over engines of their time-averaged in-flight requests
(``vllm:num_requests_running`` + ``waiting``, read every ``SAMPLE_S`` and integrated over time: each reading
holds until the next) and of the calls each served (``vllm:request_success_total``); time to first token
p50/p99 and whole-call time p50/p99 (at the client: first streamed text, end of stream); calls/s. Through the
proxy an exact continuation's stream is synthesized once its turn is whole (its reply is parsed by the engine's
derender), so its first text comes when the call is done: rollwire's TTFT is its call time, while vllm-router
relays the engine's own stream; ``call_p50_s`` compares them like for like.

Peer: vllm-router (PyPI, installed on first use into ``<cache>/vllm-router-venv``, outside rollwire's own
environment) in front of the same engines with its ``consistent_hash`` policy on the ``X-Session-ID`` header;
the same sessions sent straight to it as chat completions (the engine renders the growing history). When it
does not install or run, ``vllm_router=unavailable reason=...``.

Failover: one more run under rollwire's placement, the engine that served most calls SIGKILLed (its whole
process group) once half of the calls are done. A failed call is retried once by the client, as a harness
does; calls lost are the failed calls, a session is lost when it could not finish its turns or when a call
after the kill did not continue its branch exactly (``continuation.mode`` of its completion events on Kafka).

    python -m bench.engines [--engines 2] [--sessions 16] [--turns 13] [--max-tokens 8] [--context-tokens 1500]
                            [--result-tokens 150] [--shared-core]
                            [--policies sticky_least_loaded,round_robin,consistent_hash] [--engine-urls U,U]
                            [--no-peer] [--no-kill]

Prints ``name=value`` lines, the key figure last: ``placement_prefix_hit_rate``, beside
``round_robin_prefix_hit_rate``, ``consistent_hash_prefix_hit_rate``, ``load_spread`` (the placement's) and
``sessions_lost_to_killed_engine``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from bench.serving import free_port
from deploy import stack
from deploy.engine.server import EngineConfig, VllmServer
from deploy.kafka import KafkaConfig
from schemas import paths
from schemas.admin_token import ADMIN_TOKEN_VARIABLE
from schemas.completions import Completion
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings, delete_topics, ensure_topics

POLICIES: tuple[str, ...] = ("sticky_least_loaded", "round_robin", "consistent_hash")
LABEL = {"sticky_least_loaded": "placement"}
"""How a policy is named in the output (rollwire's own placement is the key figure)."""
ROUTER_PACKAGE = "vllm-router"
SAMPLE_S = 0.25
"""How often the engines' in-flight gauges are read during a run."""
CALL_TIMEOUT_S = 300.0
WORDS = ("def", "return", "self", "import", "path", "value", "error", "test", "assert", "config", "index",
         "result", "items", "None", "True", "for", "in", "if", "else", "class", "print", "open", "data", "json")


# ---- the engines' own metrics --------------------------------------------------------------------------


def metric_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` summed over its label sets in a Prometheus text page (0 when absent)."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            try:
                sums[name] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return sums


COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


async def read_metrics(client: httpx.AsyncClient, url: str, names: Sequence[str]) -> dict[str, float] | None:
    try:
        response = await client.get(f"{url}/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    return metric_sums(response.text, names) if response.status_code == 200 else None


async def reset_prefix_caches(client: httpx.AsyncClient, urls: Sequence[str]) -> None:
    """Empty every engine's prefix cache (a development engine's ``POST /reset_prefix_cache``)."""
    for url in urls:
        response = await client.post(f"{url}/reset_prefix_cache", timeout=30)
        if response.status_code != 200:
            raise SystemExit(f"{url}/reset_prefix_cache answered {response.status_code}: is it run with "
                             "VLLM_SERVER_DEV_MODE=1?")


@dataclass
class Sampler:
    """Reads every engine's in-flight gauges about every ``SAMPLE_S`` while a run goes on, with the time of
    each reading."""

    urls: Sequence[str]
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Per engine: (monotonic time, requests running + waiting) readings."""

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            readings = await asyncio.gather(*(read_metrics(client, url, GAUGES) for url in self.urls))
            now = time.monotonic()
            for url, got in zip(self.urls, readings):
                if got is not None:
                    self.samples.setdefault(url, []).append((now, sum(got.values())))
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_S)
            except TimeoutError:
                pass

    def time_averages(self) -> list[float]:
        """Each engine's in-flight averaged over time: every reading holds until the next one (an engine
        that stopped answering, a killed one, counts only while it answered)."""
        averages = []
        for url in self.urls:
            readings = self.samples.get(url, [])
            span = readings[-1][0] - readings[0][0] if len(readings) > 1 else 0.0
            if span <= 0:
                averages.append(statistics.fmean(v for _, v in readings) if readings else 0.0)
                continue
            area = sum(value * (later - at) for (at, value), (later, _) in zip(readings, readings[1:]))
            averages.append(area / span)
        return averages

    def spread(self) -> float:
        return spread(self.time_averages())


def spread(loads: Sequence[float]) -> float:
    """max ÷ mean (1.0: even; the number of engines: all on one)."""
    mean = statistics.fmean(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ---- the workload --------------------------------------------------------------------------------------


def system_prompt() -> str:
    rng = random.Random(0)
    tools = "\n".join(f"- tool_{i}({', '.join(rng.sample(WORDS, 3))}): " + " ".join(rng.choices(WORDS, k=40))
                      for i in range(12))
    return "You are a coding agent. Use the tools to inspect and change the repository.\n" + tools


def code_lines(seed: str, chars: int) -> str:
    """Numbered code-like lines, distinct per ``seed``, about ``chars`` characters in all."""
    rng = random.Random(seed)
    lines = []
    size = 0
    while size < chars:
        line = f"{rng.randrange(1, 999):>4}  " + " ".join(rng.choices(WORDS, k=rng.randrange(4, 12)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def first_message(index: int, chars: int) -> str:
    """A session's own long context: its task and a file the agent read, about ``chars`` characters."""
    return (f"Task {index}: the test in tests/test_service_{index}.py fails; fix src/service_{index}.py, then "
            f"report.\n\nHere is src/service_{index}.py as it is now:\n" + code_lines(f"context/{index}", chars))


def tool_result(index: int, turn: int, chars: int) -> str:
    """A tool's output: distinct per session and turn, of about ``chars`` characters."""
    return (f"<tool_response>\n$ sed -n {turn * 20},{turn * 20 + 20}p src/module_{turn}.py\n"
            + code_lines(f"result/{index}/{turn}", chars) + "\n</tool_response>")


@dataclass
class Call:
    session: str
    turn: int
    ok: bool
    started: float
    """Wall clock (time.time()) when it was sent."""
    ttft_s: float | None = None
    error: str | None = None
    retry: bool = False
    duration_s: float | None = None
    """Sent to the end of its stream."""


@dataclass
class Target:
    """Where a session's calls go: through the proxy (a session's base URL and key) or straight to a router."""

    url: str
    headers: dict[str, str]
    model: str


async def stream_call(client: httpx.AsyncClient, target: Target, messages: list[dict[str, Any]],
                      max_tokens: int) -> tuple[str, float | None]:
    """One streamed chat completion: the reply's text and the seconds to its first text."""
    body = {"model": target.model, "messages": messages, "stream": True, "max_tokens": max_tokens}
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    async with client.stream("POST", f"{target.url}/chat/completions", json=body, headers=target.headers,
                             timeout=CALL_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:200]!r}")
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - started
                text.append(piece)
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
    return "".join(text), first


@dataclass
class Workload:
    sessions: int
    turns: int
    max_tokens: int
    context_chars: int
    result_chars: int
    system: str = field(default_factory=system_prompt)


async def chars_per_token(engine_url: str) -> float:
    """How many characters of the workload's text make one token, by the engine's own tokenizer."""
    sample = first_message(0, 8000)
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(f"{engine_url}/v1/models")).json()["data"][0]["id"]
        return len(sample) / await token_count(client, engine_url, model, sample)


async def token_count(client: httpx.AsyncClient, engine_url: str, model: str, text: str) -> int:
    response = await client.post(f"{engine_url}/tokenize",
                                 json={"model": model, "prompt": text, "add_special_tokens": False})
    response.raise_for_status()
    return int(response.json()["count"])


async def workload_sizes(engine_url: str, load: Workload) -> dict[str, int]:
    """The measured sizes in tokens: the system prompt, a first message, a tool result."""
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(f"{engine_url}/v1/models")).json()["data"][0]["id"]
        return {"system_prompt_tokens": await token_count(client, engine_url, model, load.system),
                "first_message_tokens": await token_count(client, engine_url, model,
                                                          first_message(0, load.context_chars)),
                "tool_result_tokens": await token_count(client, engine_url, model,
                                                        tool_result(0, 1, load.result_chars))}


async def drive_session(client: httpx.AsyncClient, target: Target, session: str, index: int, load: Workload,
                        calls: list[Call], progress: asyncio.Event | None = None) -> bool:
    """Session ``index``'s turns; a failed call is retried once. False when the session could not go on."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": load.system},
        {"role": "user", "content": first_message(index, load.context_chars)}]
    for turn in range(load.turns):
        for attempt in (0, 1):
            started = time.time()
            try:
                text, ttft = await stream_call(client, target, messages, load.max_tokens)
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                calls.append(Call(session, turn, False, started, error=str(exc)[:200], retry=attempt == 1))
                if attempt == 1:
                    return False
                await asyncio.sleep(0.5)
                continue
            calls.append(Call(session, turn, True, started, ttft, retry=attempt == 1,
                              duration_s=time.time() - started))
            break
        if progress is not None:
            progress.set()
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": tool_result(index, turn, load.result_chars)}]
    return True


# ---- one run -------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    name: str
    hit_rate: float
    load_spread: float
    calls_spread: float
    calls_per_engine: list[int]
    ttft_p50_s: float
    ttft_p99_s: float
    call_p50_s: float
    call_p99_s: float
    in_flight_per_engine: list[float]
    calls_per_s: float
    failed_calls: int
    finished_sessions: int
    calls: list[Call]
    killed: str | None = None
    killed_at: float | None = None


async def run_policy(name: str, engine_urls: Sequence[str], targets: dict[str, Target], load: Workload,
                     kill: Callable[[int], str] | None = None) -> RunResult:
    """Every session at once against ``targets``; the engines' counters and gauges around it."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=load.sessions * 2 + 8)) as client:
        await reset_prefix_caches(client, engine_urls)
        before = [await read_metrics(client, url, COUNTERS) for url in engine_urls]
        sampler = Sampler(engine_urls)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(client, stop))
        calls: list[Call] = []
        progress = asyncio.Event()
        started = time.monotonic()
        runs = [asyncio.create_task(drive_session(client, target, session, index, load, calls, progress))
                for index, (session, target) in enumerate(targets.items())]
        killed: str | None = None
        killed_at: float | None = None
        if kill is not None:
            half = load.sessions * load.turns // 2
            while sum(c.ok for c in calls) < half and not all(r.done() for r in runs):
                progress.clear()
                await progress.wait()
            served = [await read_metrics(client, url, COUNTERS) for url in engine_urls]
            counts = [(s or {}).get("vllm:request_success_total", 0.0) - (b or {}).get("vllm:request_success_total", 0.0)
                      for s, b in zip(served, before)]
            victim = max(range(len(engine_urls)), key=lambda i: counts[i])
            killed_at = time.time()
            killed = kill(victim)
        finished = await asyncio.gather(*runs)
        elapsed = time.monotonic() - started
        stop.set()
        await sampling
        after = [await read_metrics(client, url, COUNTERS) for url in engine_urls]
    hits = queries = 0.0
    per_engine: list[int] = []
    for b, a in zip(before, after):
        if b is None or a is None:  # a killed engine: its counters are gone with it
            per_engine.append(-1)
            continue
        hits += a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
        queries += a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
        per_engine.append(round(a["vllm:request_success_total"] - b["vllm:request_success_total"]))
    ttfts = [c.ttft_s for c in calls if c.ok and c.ttft_s is not None]
    durations = [c.duration_s for c in calls if c.ok and c.duration_s is not None]
    ok = sum(c.ok for c in calls)
    return RunResult(name=name, hit_rate=hits / queries if queries else float("nan"), load_spread=sampler.spread(),
                     calls_spread=spread([n for n in per_engine if n >= 0]), calls_per_engine=per_engine,
                     ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
                     call_p50_s=percentile(durations, 50), call_p99_s=percentile(durations, 99),
                     in_flight_per_engine=sampler.time_averages(), calls_per_s=ok / elapsed, failed_calls=sum(not c.ok for c in calls),
                     finished_sessions=sum(finished), calls=calls, killed=killed, killed_at=killed_at)


def report(result: RunResult) -> None:
    label = LABEL.get(result.name, result.name)
    print(f"{label}_prefix_hit_rate={result.hit_rate:.3f}")
    print(f"{label}_load_spread={result.load_spread:.2f}")
    print(f"{label}_calls_spread={result.calls_spread:.2f}")
    print(f"{label}_calls_per_engine={'/'.join(str(n) if n >= 0 else 'killed' for n in result.calls_per_engine)}")
    print(f"{label}_in_flight_per_engine={'/'.join(f'{n:.2f}' for n in result.in_flight_per_engine)}")
    print(f"{label}_ttft_p50_s={result.ttft_p50_s:.3f}")
    print(f"{label}_ttft_p99_s={result.ttft_p99_s:.3f}")
    print(f"{label}_call_p50_s={result.call_p50_s:.3f}")
    print(f"{label}_call_p99_s={result.call_p99_s:.3f}")
    print(f"{label}_calls_per_s={result.calls_per_s:.2f}")
    print(f"{label}_failed_calls={result.failed_calls}")
    sys.stdout.flush()


# ---- through rollwire's proxy --------------------------------------------------------------------------


async def proxy_sessions(proxy_url: str, token: str, load: Workload, tag: str) -> dict[str, Target]:
    """The run's sessions on the proxy, exact continuation, replies cut at ``max_tokens``."""
    targets: dict[str, Target] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(load.sessions):
            session = f"bench-{tag}-{i:02d}-{uuid.uuid4().hex[:6]}"
            response = await client.post(f"{proxy_url}/v1/sessions", headers={"authorization": f"Bearer {token}"},
                                         json={"session_id": session, "task_id": f"bench-engines-{tag}",
                                               "engine": {"max_tokens": load.max_tokens, "temperature": 1.0,
                                                          "continuation": "exact"}})
            if response.status_code != 201:
                raise SystemExit(f"POST /v1/sessions answered {response.status_code}: {response.text[:300]}")
            created = response.json()
            targets[session] = Target(created["base_urls"]["openai"],
                                      {"authorization": f"Bearer {created['api_key']}"}, "rollwire-tiny")
    return targets


def start_proxy(kafka: KafkaSettings, parts: Sequence[stack.Part], policy: str) -> stack.Part:
    """A ``rollwire proxy`` process over the pool, placing sessions by ``policy``."""
    return stack.proxy(kafka, parts, stack.Port("127.0.0.1", free_port()),
                       env={"ROLLWIRE_ENGINE_PLACEMENT": policy, "ROLLWIRE_ENGINE_TIMEOUT_S": str(CALL_TIMEOUT_S)})


def pool_support(proxy_url: str, token: str) -> str:
    """What the proxy says of its engines (``GET /v1/engines``), in one line."""
    try:
        response = httpx.get(f"{proxy_url}/v1/engines", headers={"authorization": f"Bearer {token}"}, timeout=5)
    except httpx.HTTPError as exc:
        return f"unreachable ({exc})"
    if response.status_code != 200:
        return f"absent (GET /v1/engines answered {response.status_code}: the proxy serves one engine)"
    rows = response.json()
    rows = rows.get("engines", rows) if isinstance(rows, dict) else rows
    return ",".join(str(row.get("id")) for row in rows if isinstance(row, dict))


async def completion_events(kafka: KafkaSettings, sessions: set[str], want: int,
                            timeout_s: float = 60) -> list[Completion]:
    """The completion events of ``sessions`` on the run's topic (waiting until ``want`` are there)."""
    got: list[Completion] = []
    deadline = time.monotonic() + timeout_s
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False,
                             from_beginning=True) as consumer:
        while time.monotonic() < deadline:
            for received in await consumer.getmany(timeout_ms=500):
                event = received.event
                if isinstance(event, Completion) and event.session_id in sessions:
                    got.append(event)
            if len(got) >= want:
                break
    return got


def failover_figures(result: RunResult, events: list[Completion]) -> dict[str, object]:
    """Calls lost and sessions that went on exactly after the kill, from the client and the events."""
    assert result.killed_at is not None
    kill_time = datetime.fromtimestamp(result.killed_at, tz=timezone.utc)
    sessions = {c.session for c in result.calls}
    unfinished = {c.session for c in result.calls if not c.ok and c.retry}
    after: dict[str, list[Completion]] = {}
    for event in events:
        received = event.timings.received_at if event.timings is not None else None
        if received is not None and received >= kill_time:
            after.setdefault(event.session_id, []).append(event)
    not_exact = {session for session, calls in after.items()
                 if any(c.status == "ok" and (c.continuation is None or c.continuation.mode != "exact")
                        for c in calls)}
    pinned = {event.session_id for event in events if event.engine is not None and event.engine == result.killed
              and event.timings is not None and event.timings.received_at < kill_time}
    lost = unfinished | not_exact
    return {"calls_lost": sum(not c.ok for c in result.calls),
            "calls_retried_ok": sum(c.ok and c.retry for c in result.calls),
            "failover_attempts": sum(e.engine_attempts > 1 for e in events),
            "sessions_on_killed_engine": len(pinned),
            "sessions_on_killed_engine_continued_exactly": len(pinned - lost),
            "sessions_continued_exactly": len(sessions - lost),
            "sessions_lost_to_killed_engine": len(lost)}


# ---- the peer: vllm-router -----------------------------------------------------------------------------


def router_binary(cache_dir: Path) -> Path:
    """vllm-router from PyPI in its own environment under the cache (installed on first use)."""
    venv = cache_dir / "vllm-router-venv"
    binary = venv / "bin" / "vllm-router"
    if binary.is_file():
        return binary
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", ROUTER_PACKAGE], capture_output=True,
                             text=True, timeout=900)
    if install.returncode != 0 or not binary.is_file():
        raise RuntimeError(f"pip install {ROUTER_PACKAGE} failed: {install.stderr.strip()[-300:]}")
    return binary


class Router:
    """vllm-router over ``engine_urls`` with ``policy``, on a free port, its log in ``log``."""

    def __init__(self, binary: Path, engine_urls: Sequence[str], policy: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(binary), "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *engine_urls,
                 "--policy", policy, "--log-level", "warning", "--prometheus-port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.process.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-300:]}")
            if stack.answers(f"{self.url}/v1/models") or stack.answers(f"{self.url}/health"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"vllm-router did not answer within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


async def router_run(engine_urls: Sequence[str], load: Workload, root: Path) -> RunResult | str:
    """The peer's run, or why it could not run."""
    try:
        binary = router_binary(paths.cache_dir())
        router = Router(binary, engine_urls, "consistent_hash", root / "vllm-router.log")
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return str(exc).replace("\n", " ")[:300]
    try:
        router.wait_ready()
        targets = {f"router-{i:02d}-{uuid.uuid4().hex[:6]}": Target(f"{router.url}/v1", {}, "rollwire-tiny")
                   for i in range(load.sessions)}
        for session, target in targets.items():
            target.headers["X-Session-ID"] = session
        return await run_policy("vllm_router_consistent_hash", engine_urls, targets, load)
    except RuntimeError as exc:
        return str(exc).replace("\n", " ")[:300]
    finally:
        router.stop()


# ---- the whole benchmark -------------------------------------------------------------------------------


def start_engines(count: int, root: Path, own_cores: bool) -> tuple[list[stack.Part], list[EngineConfig]]:
    """The run's engines. ``own_cores``: engine ``i`` bound to core ``i`` (vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``), started one after another; else vLLM's automatic binding, which puts every
    engine's worker on the same first core (as ``rollwire up --engines N`` does today), so that the engines
    share one core and take turns on it unevenly."""
    base = EngineConfig.from_env()
    config = EngineConfig(cache_dir=base.cache_dir, home=root / "engine", port=stack.free_port_run(count),
                          max_model_len=16384)
    configs = stack.engine_configs(count, config)
    if not own_cores:
        return stack.engines(None, configs, timeout_s=1800), configs
    parts: list[stack.Part] = []
    cores = os.cpu_count() or 1
    try:
        for index, engine_config in enumerate(configs):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(index % cores)  # the server's environment is this one's
            [part] = stack.engines(None, [engine_config], timeout_s=1800)
            parts.append(dataclasses.replace(part, name=stack.engine_name(index)))
    except BaseException:
        for part in parts:
            if part.stop is not None:
                part.stop()
        raise
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return parts, configs


def killer(configs: Sequence[EngineConfig], parts: Sequence[stack.Part]) -> Callable[[int], str]:
    """SIGKILLs engine ``index`` and returns its name."""
    def kill(index: int) -> str:
        pid = VllmServer(configs[index]).pid()
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)  # the API server and its engine-core children, no clean shutdown
        return parts[index].name
    return kill


async def bench(args: argparse.Namespace, root: Path) -> None:
    os.environ["ROLLWIRE_HOME"] = str(root)  # the proxy processes' pid files and logs, not the user's stack
    token = secrets.token_urlsafe(24)
    os.environ[ADMIN_TOKEN_VARIABLE] = token
    configs: list[EngineConfig] = []
    if args.engine_urls:
        entries = stack.parse_engine_entries(args.engine_urls, source="--engine-urls")
        parts = stack.engines(entries, [])
    else:
        parts, configs = start_engines(args.engines, root, args.own_cores)
        cores = os.cpu_count() or 1
        print("engine_cores=" + ("/".join(str(i % cores) for i in range(len(parts))) if args.own_cores else "auto"))
    engine_urls = [part.address for part in parts]
    ratio = await chars_per_token(engine_urls[0])
    load = Workload(args.sessions, args.turns, args.max_tokens, round(args.context_tokens * ratio),
                    round(args.result_tokens * ratio))
    print(f"engines={len(parts)}")
    print(f"sessions={load.sessions}")
    print(f"turns={load.turns}")
    print(f"max_tokens={load.max_tokens}")
    for name, tokens in (await workload_sizes(engine_urls[0], load)).items():
        print(f"{name}={tokens}")
    sys.stdout.flush()
    config = KafkaConfig.from_env()
    base = stack.managed_settings(config)
    kafka_part = stack.broker(config, base.kafka_bootstrap)
    kafka = base.model_copy(update={"topic_prefix": f"bench-engines-{uuid.uuid4().hex[:8]}."})
    await ensure_topics(kafka)
    results: dict[str, RunResult] = {}
    try:
        for policy in args.policies:
            proxy = start_proxy(kafka, parts, policy)
            try:
                if policy == args.policies[0]:
                    print(f"proxy_engines={pool_support(proxy.address, token)}")
                targets = await proxy_sessions(proxy.address, token, load, LABEL.get(policy, policy))
                results[policy] = await run_policy(policy, engine_urls, targets, load)
            finally:
                assert proxy.stop is not None
                proxy.stop()
            report(results[policy])
        if args.peer:
            peer = await router_run(engine_urls, load, root)
            if isinstance(peer, str):
                print(f"vllm_router=unavailable reason={peer}")
            else:
                report(peer)
        if args.kill and configs:
            proxy = start_proxy(kafka, parts, "sticky_least_loaded")
            try:
                targets = await proxy_sessions(proxy.address, token, load, "failover")
                result = await run_policy("failover", engine_urls, targets, load, kill=killer(configs, parts))
            finally:
                assert proxy.stop is not None
                proxy.stop()
            events = await completion_events(kafka, set(targets), len(result.calls))
            print(f"killed_engine={result.killed}")
            print(f"failover_calls_per_s={result.calls_per_s:.2f}")
            for name, value in failover_figures(result, events).items():
                print(f"{name}={value}")
        elif args.kill:
            print("sessions_lost_to_killed_engine=unavailable reason=--engine-urls: no engine of this run to kill")
    finally:
        for part in parts:
            if part.stop is not None:
                part.stop()
        await delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix)
        if kafka_part.stop is not None:
            kafka_part.stop()
    for policy in ("round_robin", "consistent_hash"):
        if policy in results:
            print(f"{policy}_prefix_hit_rate={results[policy].hit_rate:.3f}")
    if "sticky_least_loaded" in results:
        placed = results["sticky_least_loaded"]
        print(f"load_spread={placed.load_spread:.2f}")
        print(f"placement_prefix_hit_rate={placed.hit_rate:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2, help="Embedded engines to start (2 or 3 on 2 cores).")
    parser.add_argument("--engine-urls", default=None, help="Reuse these engines (URL or NAME=URL, commas) "
                                                            "instead of starting some; no failover run then.")
    parser.add_argument("--sessions", type=int, default=16, help="Concurrent sessions per run.")
    parser.add_argument("--turns", type=int, default=13, help="Calls per session (the first, then one per tool "
                                                              "result).")
    parser.add_argument("--max-tokens", type=int, default=8, help="Each reply's token cap.")
    parser.add_argument("--context-tokens", type=int, default=1500,
                        help="Tokens of each session's own first message (its task and a file it read).")
    parser.add_argument("--result-tokens", type=int, default=150, help="Tokens of tool output per turn.")
    parser.add_argument("--policies", type=lambda text: [p for p in text.split(",") if p],
                        default=list(POLICIES), help="The proxy's ROLLWIRE_ENGINE_PLACEMENT values to run.")
    parser.add_argument("--shared-core", dest="own_cores", action="store_false",
                        help="Leave the engines' core binding to vLLM (every engine on the first core, as rollwire "
                             "up does) instead of one core each.")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="Skip vllm-router.")
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="Skip the failover run.")
    args = parser.parse_args()
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        asyncio.run(bench(args, Path(tmp)))


if __name__ == "__main__":
    main()
