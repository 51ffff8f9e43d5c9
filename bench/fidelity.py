"""Token fidelity of the real CLIs on the real engine: exact-token continuation versus full re-rendering.

The six real harness CLIs (``codex``, ``claude-code``, ``qwen-code``, ``pi``, ``gemini-cli``, ``opencode``;
pinned, installed from npm on first use) run the example task (``examples/tasks.jsonl``: its repository and instruction, tasks taken in
turn by sample index) against the engine at ``--engine-url`` (default ``ROLLWIRE_ENGINE_URL``, else
``http://127.0.0.1:18000``), *unforced*: the model samples freely (``temperature 1``, no seed, ``--max-tokens``
per reply), in both of a session's continuation modes:

- ``exact`` (the default): a call that continues a branch is sent as the branch's exact tokens (prompt +
  sampled ids) + the tokens of only the new messages;
- ``rendered``: the chat template renders the whole history each time (the harness's echo of the sampled
  text, re-tokenized).

Everything runs in this process, as in ``bench.rollout``: the proxy (``proxy.app.create_app``) in front of
the engine, a gateway node with the local runtime, on a fresh topic prefix of the broker at
``ROLLWIRE_KAFKA_BOOTSTRAP`` (deleted at the end). Sessions are published as ``SessionSpec`` events; once
every ``session.ended`` is in, each session's completions are read back and built with the
``prefix_merging`` builder in process.

Per harness and mode it prints: sessions (by status), calls (failed ones apart), traces, rows per
session, exact calls, drift kinds over the exact-mode calls (how often a full re-render of the history
would have differed from the exact prompt, and why), branches opened and why (``continuation.opened``),
branch and trace roles. Exact-mode calls that opened a branch for another reason than being the
session's first call or the agent's first (after side calls such as opencode's title), and failed calls,
are listed with their continuation block; the proxy's log goes to ``--proxy-log``.

Re-scoring (``--rescore``, on by default): every exact-mode trace of at most ``--rescore-max-tokens``
tokens is scored again by the engine (``/v1/completions`` with the trace's ids as the prompt,
``prompt_logprobs: 0``, ``temperature: 1``); the share of trainable positions (loss mask 1) whose prompt
logprob is within 1e-3 of the recorded one is ``rescore_agreement``, and the engine's own batch-to-batch
noise (one trace scored twice) is ``rescore_noise_agreement``. Longer traces are skipped and counted: a
prompt_logprobs request over a very long prompt (151k vocabulary) stalls the CPU engine until it exits.

Rows per branch: traces of role ``main`` or ``sub_agent`` divided by the distinct ``continuation.branch``
values of those roles (per session); 1.00 means every agent branch is one training row.

    python -m bench.fidelity [--engine-url URL] [--harness H ...] [--samples N] [--modes exact,rendered]
                             [--max-tokens T] [--timeout-s S] [--no-rescore] [--rescore-max-tokens K]

Prints ``name=value`` lines, the key figure last: ``exact_rows_per_branch`` (goal 1.00), with
``rendered_rows_per_branch`` beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.serving import serve
from processors.builders.common import SessionFacts
from processors.builders.prefix_merging import build as build_prefix_merging
from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings
from producers.harness_install import ensure_harness
from producers.rollout.taskfile import load_tasks
from producers.runtimes.local import LocalRuntime
from proxy.app import create_app as create_proxy
from proxy.settings import ProxySettings
from schemas.completions import Completion
from schemas.prompt_chain import resolve_session
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.tasks import AgentSpec, EngineParams, TaskRequest
from schemas.topics import Topic
from schemas.trajectories import Trace, Trajectory
from schemas.transport import EventConsumer, EventProducer, KafkaSettings, delete_topics, ensure_topics

HARNESSES: tuple[str, ...] = ("codex", "claude-code", "qwen-code", "pi", "gemini-cli", "opencode")
MODES: tuple[str, ...] = ("exact", "rendered")
AGENT_ROLES: frozenset[str] = frozenset({"main", "sub_agent"})
TOLERANCE = 1e-3
"""Two logprobs agree when they differ by at most this much."""
DEFAULT_TASKS = Path(__file__).resolve().parent.parent / "examples" / "tasks.jsonl"
END_MARGIN_S = 300.0
"""Beyond the sessions' own budgets, how long to wait for the last ``session.ended``."""
SHOW_LIMIT = 20
"""Most exact-mode opened or failed calls listed by name."""
_ERROR_PHRASE = re.compile(r"\b(?:API Error|ERROR|Error|error):\s[^\n\"]{1,160}")
"""The harness's own error message in its output (Codex ``ERROR: …``, Claude Code ``API Error: …``)."""


# ---- what a run produces ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One session to run: which harness, which continuation mode, which sample."""

    harness: str
    mode: str
    index: int
    spec: SessionSpec


@dataclass(slots=True)
class SessionResult:
    """A sample's end, its completion events and the trajectory built from them."""

    sample: Sample
    ended: SessionEnded | None = None
    completions: list[Completion] = field(default_factory=list)
    trajectory: Trajectory | None = None

    @property
    def session_id(self) -> str:
        return self.sample.spec.session_id

    def usable(self) -> list[Completion]:
        """The calls a builder trains on: status ok, with token ids, in sequence order."""
        return sorted((c for c in self.completions if c.status == "ok" and c.token_ids is not None
                       and c.prompt_token_ids is not None), key=lambda c: c.sequence)


@dataclass(slots=True)
class RescoreResult:
    """Recorded logprobs against the engine's prompt logprobs of the same tokens."""

    traces: int = 0
    skipped_long: int = 0
    skipped_empty: int = 0
    positions: int = 0
    agreeing: int = 0
    max_abs_diff: float = 0.0
    noise_positions: int = 0
    noise_agreeing: int = 0
    noise_max_abs_diff: float = 0.0
    error: str | None = None

    @property
    def agreement(self) -> float:
        return self.agreeing / self.positions if self.positions else math.nan

    @property
    def noise_agreement(self) -> float:
        return self.noise_agreeing / self.noise_positions if self.noise_positions else math.nan


# ---- serving in this process --------------------------------------------------------------------------


class _WarningsKept(logging.Handler):
    """Keeps the proxy's warnings and errors, to be shown with the calls they concern."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _proxy_logging(path: Path) -> _WarningsKept:
    """The proxy's log (INFO and up) into ``path``; its warnings also kept in memory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    # Appending: uvicorn's logging set-up closes existing handlers, and a closed "w" handler never reopens.
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    kept = _WarningsKept()
    logger = logging.getLogger("proxy")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    logger.addHandler(kept)
    return kept


# ---- the phases ---------------------------------------------------------------------------------------


async def _install(harnesses: Sequence[str]) -> dict[str, str]:
    """Install each harness CLI (pinned) if needed; the ones that failed, with why."""
    errors: dict[str, str] = {}
    for harness in harnesses:
        try:
            await asyncio.to_thread(ensure_harness, harness)
        except Exception as exc:  # npm missing, registry unreachable, a broken package: report and go on
            errors[harness] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return errors


def _samples(harnesses: Sequence[str], modes: Sequence[str], tasks: Sequence[TaskRequest],
             args: argparse.Namespace) -> list[Sample]:
    """Sample i of every harness and mode runs task i (in turn), unseeded."""
    run = uuid.uuid4().hex[:6]
    samples: list[Sample] = []
    for harness in harnesses:
        for mode in modes:
            for index in range(args.samples):
                task = tasks[index % len(tasks)]
                # No seed: the CPU build's engine core dies on a seeded request whose prefill gets chunked,
                # which concurrent long harness prompts cause (see deploy/engine/server.py).
                engine = EngineParams(continuation=mode, max_tokens=args.max_tokens, temperature=1.0)
                spec = SessionSpec(session_id=f"fidelity-{run}-{harness}-{mode}-{index}", task_id=task.task_id,
                                   sample_index=index, instruction=task.instruction,
                                   runtime=task.runtime.model_copy(deep=True), agent=AgentSpec(harness=harness),
                                   builder="prefix_merging", engine=engine, timeout_s=args.timeout_s,
                                   api_key=f"key-{uuid.uuid4().hex}",
                                   metadata={"bench": "fidelity", "harness": harness, "mode": mode})
                samples.append(Sample(harness, mode, index, spec))
    return samples


async def _run_sessions(samples: Sequence[Sample], args: argparse.Namespace, kafka: KafkaSettings,
                        root: Path) -> dict[str, SessionResult]:
    """Publish every sample's spec, wait for every ``session.ended``, and collect the completions."""
    results = {s.spec.session_id: SessionResult(s) for s in samples}
    if not samples:
        return results
    proxy_settings = ProxySettings(engine_url=args.engine_url, session_wait_s=3.0)
    with serve(create_proxy(proxy_settings, kafka)) as proxy_url:
        settings = GatewaySettings(proxy_url=proxy_url, port=0, run_slots=args.run_slots, prewarm=args.run_slots,
                                   init_workers=args.run_slots, post_workers=2, node_name="bench-fidelity")
        node = GatewayNode(settings, kafka, runtime_for=lambda kind: LocalRuntime(root=root))
        node_task = asyncio.create_task(node.run())
        try:
            await asyncio.wait_for(node.started.wait(), 60)
            rounds = math.ceil(len(samples) / args.run_slots)
            deadline = time.monotonic() + rounds * args.timeout_s + END_MARGIN_S
            async with EventConsumer(kafka, [Topic.SESSION_EVENTS, Topic.COMPLETIONS], group_id=None,
                                     dead_letters=False, from_beginning=True) as consumer:
                async with EventProducer(kafka, service="bench-fidelity") as producer:
                    while node.partitions() == 0:
                        await asyncio.sleep(0.1)
                    await producer.send_many([s.spec for s in samples])
                ended = 0
                while ended < len(results) and time.monotonic() < deadline:
                    ended += _take(await consumer.getmany(timeout_ms=500), results)
                # The completions of the last sessions may sit on partitions not read yet.
                while await consumer.lag() > 0:
                    _take(await consumer.getmany(timeout_ms=500), results)
        finally:
            node.drain()
            await asyncio.wait_for(node_task, 300)
    return results


def _take(batch: Iterable[Any], results: dict[str, SessionResult]) -> int:
    """File each received event under its session; the number of sessions that ended with this batch."""
    ended = 0
    for received in batch:
        event = received.event
        result = results.get(getattr(event, "session_id", ""))
        if result is None:
            continue
        if isinstance(event, Completion):
            result.completions.append(event)
        elif isinstance(event, SessionEnded) and result.ended is None:
            result.ended = event
            ended += 1
    return ended


def _build(results: Iterable[SessionResult]) -> None:
    for result in results:
        # Prompts resolved first (deltas against earlier calls); a call whose parent is not in the log is
        # left out (never built from its new tokens alone).
        result.completions = resolve_session(result.completions).resolved
        ended = result.ended
        facts = SessionFacts(session_id=result.session_id, task_id=result.sample.spec.task_id,
                             status=ended.status if ended else None, failure=ended.failure if ended else None,
                             partial=ended is None)
        result.trajectory = build_prefix_merging(result.completions, facts)


async def _engine_check(engine_url: str) -> tuple[str, bool]:
    """The engine's model and whether it serves the token endpoints (exact mode needs them; without them
    the proxy renders every prompt whole and says so: ``opened: engine_has_no_token_api``)."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            response = await client.get(f"{engine_url}/v1/models")
            response.raise_for_status()
            model = str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise SystemExit(f"the engine at {engine_url} does not answer /v1/models: {exc!r}") from exc
        render = await client.post(f"{engine_url}/v1/chat/completions/render",
                                   json={"model": model, "messages": [{"role": "user", "content": "d"}]})
    return model, render.status_code == 200


# ---- re-scoring ---------------------------------------------------------------------------------------


async def _prompt_logprobs(client: httpx.AsyncClient, engine_url: str, model: str,
                           token_ids: list[int]) -> np.ndarray:
    """The engine's logprob of each token given the ones before it (NaN at position 0)."""
    response = await client.post(f"{engine_url}/v1/completions", json={
        "model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"]
    if len(entries) != len(token_ids):
        raise ValueError(f"{len(entries)} prompt logprobs for a {len(token_ids)}-token prompt")
    scored = np.full(len(token_ids), np.nan, dtype=np.float64)
    for position, (token, entry) in enumerate(zip(token_ids, entries)):
        if entry is not None:
            scored[position] = entry[str(token)]["logprob"]
    return scored


async def _rescore(traces: Sequence[Trace], engine_url: str, max_tokens: int) -> RescoreResult:
    """Score each trace's tokens again and compare the trainable positions with the recorded logprobs."""
    out = RescoreResult()
    engine_url = engine_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        try:
            models = (await client.get(f"{engine_url}/v1/models")).json()["data"]
            model = str(models[0]["id"])
            noise_done = False
            for trace in traces:
                tokens = trace.token_ids.numpy
                mask = trace.loss_mask.numpy.astype(bool)
                if len(tokens) > max_tokens:
                    out.skipped_long += 1
                    continue
                if not mask.any():
                    out.skipped_empty += 1
                    continue
                ids = [int(t) for t in tokens]
                scored = await _prompt_logprobs(client, engine_url, model, ids)
                recorded = trace.logprobs.numpy.astype(np.float64)
                diff = np.abs(scored[mask] - recorded[mask])
                out.traces += 1
                out.positions += int(mask.sum())
                out.agreeing += int(np.sum(diff <= TOLERANCE))
                out.max_abs_diff = max(out.max_abs_diff, float(np.nanmax(diff)) if diff.size else 0.0)
                if not noise_done:
                    again = await _prompt_logprobs(client, engine_url, model, ids)
                    both = ~np.isnan(scored) & ~np.isnan(again)
                    noise = np.abs(scored[both] - again[both])
                    out.noise_positions = int(both.sum())
                    out.noise_agreeing = int(np.sum(noise <= TOLERANCE))
                    out.noise_max_abs_diff = float(noise.max()) if noise.size else 0.0
                    noise_done = True
        except (httpx.HTTPError, KeyError, ValueError, IndexError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
    return out


# ---- figures ------------------------------------------------------------------------------------------


def _counts(counter: Counter[str]) -> str:
    return ",".join(f"{key}:{value}" for key, value in sorted(counter.items())) or "-"


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}" if denominator else "nan"


def _agent_sequences(result: SessionResult) -> set[int] | None:
    """The sequences of the session's calls in traces of role main or sub_agent (None: not built). The
    traces' roles, not the calls': a tool-less call made before the agent's first one (opencode's title
    call) was recorded as ``main`` and is settled as a side trace by the builder."""
    if result.trajectory is None:
        return None
    return {s for t in result.trajectory.traces if t.role in AGENT_ROLES for s in t.sequences}


def _agent_branches(results: Iterable[SessionResult]) -> tuple[int, int]:
    """(agent traces, distinct agent branches): traces of role main or sub_agent, and the
    ``continuation.branch`` values of their calls, per session."""
    traces = branches = 0
    for result in results:
        agent = _agent_sequences(result)
        if result.trajectory is not None:
            traces += sum(t.role in AGENT_ROLES for t in result.trajectory.traces)
        branches += len({c.continuation.branch for c in result.usable() if c.continuation is not None and (
            c.sequence in agent if agent is not None else c.continuation.role in AGENT_ROLES)})
    return traces, branches


def _drift(events: Iterable[Completion]) -> Counter[str]:
    """Drift kinds over exact-mode calls: each kind once per call showing it, ``none`` when none."""
    drift: Counter[str] = Counter()
    for event in events:
        continuation = event.continuation
        if continuation is None or continuation.mode != "exact" or continuation.drift is None:
            continue
        if continuation.drift.differs:
            drift.update(set(continuation.drift.kinds) or {"other"})
        else:
            drift["none"] += 1
    return drift


def _failure_line(ended: SessionEnded) -> str:
    """A failed session in one line: status, whose fault, exit code and the harness's own error message
    (the first error phrase in the reason or the harness's output tails), else the reason's head."""
    texts = [ended.reason or "", *ended.artifacts.values()]
    found = next((m.group(0) for text in texts for m in [_ERROR_PHRASE.search(text)] if m), None)
    detail = found or (ended.reason or "").strip().replace("\n", " ")[:160]
    failure = ended.failure.value if ended.failure else "-"
    return f"{ended.status.value} ({failure}, exit {ended.exit_code}): {detail.strip()}"


def _print_group(name: str, results: Sequence[SessionResult]) -> None:
    """The figures of one harness and mode."""
    statuses: Counter[str] = Counter(r.ended.status.value if r.ended else "not_ended" for r in results)
    calls = [c for r in results for c in r.completions]
    failed = [c for c in calls if c.status != "ok"]
    usable = [c for r in results for c in r.usable()]
    traces = [t for r in results if r.trajectory is not None for t in r.trajectory.traces]
    opened: Counter[str] = Counter(c.continuation.opened for c in usable
                                   if c.continuation is not None and c.continuation.opened)
    branch_roles: Counter[str] = Counter()
    for result in results:
        roles = {(c.continuation.branch, c.continuation.role) for c in result.usable() if c.continuation is not None}
        branch_roles.update(role for _, role in roles)
    agent_traces, agent_branches = _agent_branches(results)
    print(f"{name}_sessions={len(results)}")
    print(f"{name}_status={_counts(statuses)}")
    print(f"{name}_calls={len(calls)}")
    print(f"{name}_failed_calls={len(failed)}")
    print(f"{name}_sampled_tokens={sum(len(c.token_ids) for c in usable if c.token_ids is not None)}")
    print(f"{name}_traces={len(traces)}")
    print(f"{name}_rows_per_session={_ratio(len(traces), len(results))}")
    print(f"{name}_rows_per_branch={_ratio(agent_traces, agent_branches)}")
    print(f"{name}_exact_calls={sum(1 for c in usable if c.continuation and c.continuation.mode == 'exact')}")
    print(f"{name}_drift={_counts(_drift(usable))}")
    print(f"{name}_opened={_counts(opened)}")
    print(f"{name}_branch_roles={_counts(branch_roles)}")
    print(f"{name}_trace_roles={_counts(Counter(t.role for t in traces))}")
    print(f"{name}_max_trace_tokens={max((len(t.token_ids) for t in traces), default=0)}")
    for result in results:
        ended = result.ended
        if ended is not None and ended.status is not SessionStatus.COMPLETED:
            print(f"{name}_ended_{ended.status.value}={result.session_id}: {_failure_line(ended)}")


def _print_suspects(results: Sequence[SessionResult], warnings: Sequence[str]) -> None:
    """Exact-mode calls that opened a branch without being the first call, and failed calls."""
    shown = 0
    for result in results:
        if result.sample.mode != "exact":
            continue
        agent = _agent_sequences(result)
        # The agent's first call opens its line whatever came before it (side calls: a title, a router).
        first_agent_call = min(agent) if agent else None
        for call in sorted(result.completions, key=lambda c: c.sequence):
            continuation = call.continuation
            suspect = call.status != "ok" or (continuation is not None and continuation.mode != "exact"
                                              and continuation.opened not in (None, "first_call")
                                              and call.sequence != first_agent_call)
            if not suspect:
                continue
            shown += 1
            if shown > SHOW_LIMIT:
                continue
            block = continuation.model_dump_json(exclude_none=True, exclude_defaults=True) if continuation else "-"
            error = f" error={call.error.kind}:{call.error.message[:160]}" if call.error else ""
            print(f"exact_suspect={result.session_id} sequence={call.sequence} status={call.status}{error} "
                  f"continuation={block}")
    print(f"exact_suspects={shown}")
    kinds: Counter[str] = Counter(c.error.kind for r in results for c in r.completions if c.error is not None)
    print(f"failed_call_kinds={_counts(kinds)}")
    print(f"proxy_warnings={len(warnings)}")
    for line in warnings[:SHOW_LIMIT]:
        print(f"proxy_warning={line[:300]}")


# ---- main ---------------------------------------------------------------------------------------------


async def collect(harnesses: Sequence[str], tasks: Sequence[TaskRequest],
                  args: argparse.Namespace) -> tuple[dict[str, SessionResult], KafkaSettings]:
    """Run every sample (``args``: engine_url, modes, samples, max_tokens, timeout_s, run_slots) on a fresh
    topic prefix, deleted afterwards, and build each session's trajectory; also used by the tests."""
    kafka = KafkaSettings().model_copy(update={"topic_prefix": f"bench-fidelity-{uuid.uuid4().hex[:8]}."})
    await ensure_topics(kafka)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-fidelity-") as tmp:
            results = await _run_sessions(_samples(harnesses, args.modes, tasks, args), args, kafka, Path(tmp))
    finally:
        await delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix)
    _build(results.values())
    return results, kafka


async def bench(args: argparse.Namespace) -> None:
    started = time.monotonic()
    phases: dict[str, float] = {}
    warnings = _proxy_logging(args.proxy_log)
    tasks = [line.request for line in load_tasks(args.tasks)[0]]
    if not tasks:
        raise SystemExit(f"no task in {args.tasks}")

    args.engine_url = args.engine_url.rstrip("/")
    model, token_api = await _engine_check(args.engine_url)
    clock = time.monotonic()
    install_errors = await _install(args.harness)
    phases["install"] = time.monotonic() - clock
    harnesses = [h for h in args.harness if h not in install_errors]

    clock = time.monotonic()
    results, kafka = await collect(harnesses, tasks, args)
    phases["sessions"] = time.monotonic() - clock

    rescore = RescoreResult()
    if args.rescore:
        clock = time.monotonic()
        exact_traces = [t for r in results.values() if r.sample.mode == "exact" and r.trajectory is not None
                        for t in r.trajectory.traces]
        rescore = await _rescore(exact_traces, args.engine_url, args.rescore_max_tokens)
        phases["rescore"] = time.monotonic() - clock

    print(f"engine_url={args.engine_url}")
    print(f"engine_model={model}")
    print(f"engine_token_api={str(token_api).lower()}")
    print(f"topic_prefix={kafka.topic_prefix}")
    print(f"proxy_log={args.proxy_log}")
    print(f"samples={args.samples}")
    print(f"max_tokens={args.max_tokens}")
    for harness, error in install_errors.items():
        print(f"harness_error_{harness}={error}")
    by_group: dict[tuple[str, str], list[SessionResult]] = defaultdict(list)
    for result in results.values():
        by_group[(result.sample.harness, result.sample.mode)].append(result)
    for harness in harnesses:
        group = [r for mode in args.modes for r in by_group[(harness, mode)]]
        failed = [r.ended for r in group if r.ended is None or r.ended.status is not SessionStatus.COMPLETED]
        if group and len(failed) == len(group):  # not one session ran to completion: say why
            first = failed[0]
            print(f"harness_error_{harness}={len(failed)}/{len(group)} sessions did not complete; "
                  f"{_failure_line(first) if first is not None else 'not ended'}")
        for mode in args.modes:
            _print_group(f"{harness}_{mode}", by_group[(harness, mode)])
    _print_suspects(list(results.values()), warnings.lines)
    for name, seconds in phases.items():
        print(f"phase_{name}_s={seconds:.1f}")
    print(f"wall_s={time.monotonic() - started:.1f}")

    rendered = [r for r in results.values() if r.sample.mode == "rendered"]
    exact = [r for r in results.values() if r.sample.mode == "exact"]
    rows = {mode: sum(len(r.trajectory.traces) for r in group if r.trajectory is not None)
            for mode, group in (("rendered", rendered), ("exact", exact))}
    print(f"rendered_rows_per_session={_ratio(rows['rendered'], len(rendered))}")
    print(f"exact_rows_per_session={_ratio(rows['exact'], len(exact))}")
    if args.rescore:
        print(f"rescore_traces={rescore.traces}")
        print(f"rescore_skipped_long={rescore.skipped_long}")
        print(f"rescore_skipped_untrainable={rescore.skipped_empty}")
        print(f"rescore_positions={rescore.positions}")
        print(f"rescore_max_abs_diff={rescore.max_abs_diff:.6f}")
        print(f"rescore_noise_positions={rescore.noise_positions}")
        print(f"rescore_noise_max_abs_diff={rescore.noise_max_abs_diff:.6f}")
        print(f"rescore_noise_agreement={rescore.noise_agreement:.4f}")
        if rescore.error:
            print(f"rescore_error={rescore.error}")
        print(f"rescore_agreement={rescore.agreement:.4f}")
    print(f"rendered_rows_per_branch={_ratio(*_agent_branches(rendered))}")
    print(f"exact_rows_per_branch={_ratio(*_agent_branches(exact))}")


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODES)}; got {text!r}")
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-url", default=os.environ.get("ROLLWIRE_ENGINE_URL") or "http://127.0.0.1:18000")
    parser.add_argument("--harness", action="append", choices=HARNESSES,
                        help="A harness to run (repeatable); default: all four.")
    parser.add_argument("--samples", type=int, default=2, help="Sessions per harness and mode.")
    parser.add_argument("--modes", type=_modes, default=list(MODES), help="Comma-separated: exact,rendered.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Engine max_tokens per reply.")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="Each session's budget.")
    parser.add_argument("--run-slots", type=int, default=4, help="Harness runs at once.")
    parser.add_argument("--tasks", type=Path, default=DEFAULT_TASKS, help="Tasks file (sample i runs task i).")
    parser.add_argument("--rescore", action=argparse.BooleanOptionalAction, default=True,
                        help="Re-score exact-mode traces with the engine's prompt logprobs.")
    parser.add_argument("--rescore-max-tokens", type=int, default=6000,
                        help="Longest trace re-scored (longer prompt_logprobs requests stall the CPU engine).")
    parser.add_argument("--proxy-log", type=Path,
                        default=Path(tempfile.gettempdir()) / "bench-fidelity-proxy.log")
    args = parser.parse_args()
    args.harness = list(dict.fromkeys(args.harness or HARNESSES))
    if args.samples < 1 or args.run_slots < 1:
        parser.error("--samples and --run-slots must be at least 1")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # transient NotLeader noise on fresh topics
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
