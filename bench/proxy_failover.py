"""A proxy process dies mid-rollout and no session loses its exact tokens: the main job on a proxy tier.

Runs the main job (deploy/job.py) with ``--proxies 2``: two ``rollwire proxy`` processes behind the HAProxy
front, over the stand-in engine with vLLM's token endpoints (so calls continue exactly), the project's
Kafka, and many short sessions of a ``command`` harness (bench/failover.py's: chat calls that continue one
conversation, each carrying a nonce, retrying what SDKs retry: 5xx, a broken or refused connection; one log
line per call as the harness saw it). With ``--harness qwen-code`` the sessions run the real Qwen Code CLI
instead (its own calls and retries; no per-call log, so ``lost`` then compares events with the calls the
proxies counted).

Once ``--kill-after`` of the calls are answered, the proxy process that served most of them so far is
SIGKILLed (calls in flight on it break: the harness retries them, the front sends them to the other
process, which reads the session's branches back from the log), and started again ``--down-s`` later. Then
it reads the log back:

- ``lost``: answered calls with no recorded ``ok`` completion carrying their nonce; ``duplicated``: answered
  calls with more than one that is not marked as a retry of the other (a retry of a call whose event was
  written but whose reply was cut by the kill is a second sample of that call, counted as
  ``retried_after_kill``);
- ``exact_share``: of the calls that continue a conversation, those whose prompt was built exactly from
  their branch; ``traces_per_branch``: traces the trajectory worker built per branch the proxy opened (1.00
  is one training row per branch);
- ``restore_p50_ms``, ``restore_p99_ms``, ``restore_bytes_p50``: the reads of a session's log that calls
  waited for (each event says, ``continuation.restore``), and ``restores``: how many;
- ``longest_wait_s``: the longest a harness waited for one call, retries included.

    python -m bench.proxy_failover [--tasks 6] [--samples 3] [--calls 8] [--kill-after 0.4] [--down-s 5]
                                   [--latency-ms 250]
                                   [--harness command|qwen-code]

Prints ``name=value`` lines, the key figure last: ``lost`` (the goal is 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from bench.failover import NONCE, CallLine, _calls, _read_all, _tasks_file
from bench.serving import free_port, serve
from deploy import job as rollout_job
from deploy import stack
from deploy.kafka import KafkaBroker, KafkaConfig
from deploy.services import ServiceProcess
from deploy.settings import ProxyTierSettings, load
from schemas.completions import Completion
from schemas.sessions import SessionEnded
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import KafkaSettings, delete_topics, ensure_topics
from tests.support.standin_engine import StandinConfig, create_app as create_standin

PROXIES = 2


@dataclass
class Outcome:
    """One run's figures."""

    answered: int = 0
    unanswered: int = 0
    events: int = 0
    lost: int = 0
    duplicated: int = 0
    retried_after_kill: int = 0
    continuing_calls: int = 0
    exact_share: float = 0.0
    sessions_moved: int = 0
    """Sessions whose calls more than one proxy process served (they changed process mid-session)."""
    branches: int = 0
    traces: int = 0
    traces_per_branch: float = 0.0
    restores: int = 0
    restore_p50_ms: float = 0.0
    restore_p99_ms: float = 0.0
    restore_bytes_p50: float = 0.0
    longest_wait_s: float = 0.0
    harness_errors: int = 0
    sessions_ended: int = 0
    job_exit_code: int = -1
    killed: str = ""
    killed_at_s: float = 0.0
    details: dict[str, list[str]] = field(default_factory=dict)


def _served_by(kafka: KafkaSettings) -> collections.Counter[str]:
    events = asyncio.run(_read_all(kafka, [Topic.COMPLETIONS]))
    return collections.Counter(e.proxy for e in events if isinstance(e, Completion) and e.proxy)


def _kill_and_restart(kafka: KafkaSettings, engine_url: str, log: Path, expected: int, kill_after: float,
                      down_s: float, outcome: Outcome, done: threading.Event) -> None:
    """Wait for ``kill_after`` of the calls, SIGKILL the busiest proxy process, start it again ``down_s``
    later through the tier's own bring-up (which starts its dead processes where the front expects them)."""
    started = time.monotonic()
    while not done.is_set() and sum(1 for c in _calls(log) if c["answered"]) < kill_after * expected:
        time.sleep(0.1)
    if done.is_set():
        return
    busiest = _served_by(kafka).most_common(1)
    victim = busiest[0][0] if busiest else "proxy-0"
    _, members = stack.tier_services()
    process = next((m for m in members if m.name == victim), None)
    pid = process.pid() if process is not None else None
    if pid is None:
        return
    os.kill(pid, signal.SIGKILL)
    outcome.killed, outcome.killed_at_s = victim, time.monotonic() - started
    time.sleep(down_s)
    if not done.is_set():
        stack.proxy_tier(kafka, engine_url, stack.Port("127.0.0.1", int(os.environ["ROLLWIRE_PROXY_PORT"])),
                         load(ProxyTierSettings).model_copy(update={"count": PROXIES}))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _compare(kafka: KafkaSettings, calls: list[CallLine], outcome: Outcome) -> None:
    events = asyncio.run(_read_all(kafka, [Topic.COMPLETIONS, Topic.SESSION_EVENTS, Topic.TRAJECTORIES]))
    completions: dict[str, Completion] = {}
    trajectories: dict[str, Trajectory] = {}
    ended: set[str] = set()
    for event in events:
        if isinstance(event, Completion):
            completions[event.event_id] = event
        elif isinstance(event, Trajectory):
            trajectories[event.session_id] = event  # the latest build of each session
        elif isinstance(event, SessionEnded):
            ended.add(event.session_id)
    served = [c for c in completions.values() if c.status == "ok"]
    outcome.events = len(served)
    by_nonce: dict[str, list[Completion]] = collections.defaultdict(list)
    for completion in served:
        nonces = NONCE.findall(completion.request.model_dump_json())
        if nonces:
            by_nonce[nonces[-1]].append(completion)
    answered = [c for c in calls if c["answered"]]
    outcome.answered, outcome.unanswered = len(answered), len(calls) - len(answered)
    lost = [c["nonce"] for c in answered if not by_nonce.get(c["nonce"])]
    outcome.lost = len(lost)
    for call in answered:
        recorded = by_nonce.get(call["nonce"], [])
        retries = [c for c in recorded if c.continuation is not None and c.continuation.retry_of_sequence is not None]
        outcome.retried_after_kill += len(retries)
        outcome.duplicated += int(len(recorded) - len(retries) > 1)
    continuing = [c for c in served if c.continuation is not None and c.continuation.opened != "first_call"
                  and c.sequence > 0]
    outcome.continuing_calls = len(continuing)
    exact = [c for c in continuing if c.continuation is not None and c.continuation.mode == "exact"]
    outcome.exact_share = len(exact) / len(continuing) if continuing else 0.0
    servers: dict[str, set[str]] = collections.defaultdict(set)
    for completion in served:
        servers[completion.session_id].add(completion.proxy or "")
    outcome.sessions_moved = sum(1 for names in servers.values() if len(names) > 1)
    branches = {(c.session_id, c.continuation.branch) for c in served if c.continuation is not None}
    outcome.branches = len(branches)
    outcome.traces = sum(len(t.traces) for s, t in trajectories.items() if any(b[0] == s for b in branches))
    outcome.traces_per_branch = outcome.traces / len(branches) if branches else 0.0
    restores = [c.continuation.restore for c in served if c.continuation is not None and c.continuation.restore]
    outcome.restores = len(restores)
    outcome.restore_p50_ms = _pct([r.ms for r in restores], 0.5)
    outcome.restore_p99_ms = _pct([r.ms for r in restores], 0.99)
    outcome.restore_bytes_p50 = _pct([float(r.bytes_read) for r in restores], 0.5)
    outcome.longest_wait_s = max((c["seconds"] for c in calls), default=0.0)
    outcome.harness_errors = sum(len(c["errors"]) for c in calls)
    outcome.sessions_ended = len(ended)
    twice = [f"{c.session_id}/{c.sequence} by {c.proxy} retry_of={c.retry_of} "
             f"retry_of_sequence={c.continuation.retry_of_sequence if c.continuation else None}"
             for recorded in by_nonce.values() if len(recorded) > 1 for c in recorded]
    rendered = [f"{c.session_id}/{c.sequence}: {c.continuation.opened}" for c in continuing
                if c.continuation is not None and c.continuation.mode != "exact"]
    outcome.details = {"lost": lost[:10], "rendered": rendered[:10], "recorded_twice": twice[:10],
                       "traces_over_one": [f"{s}: {len(t.traces)} traces" for s, t in trajectories.items()
                                           if len(t.traces) > len({b for b in branches if b[0] == s})][:10]}


def run(work: Path, bootstrap: str, *, tasks: int, samples: int, calls: int, kill_after: float, down_s: float,
        harness: str, latency_ms: float) -> Outcome:
    work.mkdir(parents=True, exist_ok=True)
    home, log = work / "home", work / "calls.jsonl"
    tasks_file = _tasks_file(work, tasks, samples, calls, log)
    kafka = KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=f"pf{uuid.uuid4().hex[:8]}.")
    outcome = Outcome()
    saved = dict(os.environ)
    with serve(create_standin(StandinConfig(latency_ms=latency_ms, reply_tokens=8, token_api=True))) as engine_url:
        os.environ.update({
            "ROLLWIRE_HOME": str(home), "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap,
            "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix, "ROLLWIRE_ENGINE_URL": engine_url,
            "ROLLWIRE_PROXY_PORT": str(free_port()), "ROLLWIRE_PROXY_TIER_PORT": str(free_port()),
            "ROLLWIRE_PROXY_STATS_PORT": str(free_port()), "ROLLWIRE_PROCESSORS_PORT": str(free_port()),
            "ROLLWIRE_PROCESSORS_STORE": "memory", "ROLLWIRE_ROLLOUT_PORT": str(free_port()),
            "ROLLWIRE_GATEWAY_PORT": str(free_port()), "ROLLWIRE_GROUPS_PORT": str(free_port()),
            "ROLLWIRE_GROUPS_STORE": "memory"})
        done = threading.Event()
        breaker = threading.Thread(target=_kill_and_restart, args=(
            kafka, engine_url, log, tasks * samples * calls, kill_after, down_s, outcome, done), daemon=True)
        try:
            asyncio.run(ensure_topics(kafka))
            breaker.start()
            with (work / "job.log").open("w") as job_log:
                console = Console(file=job_log, width=200, color_system=None)
                outcome.job_exit_code = rollout_job.run_job(rollout_job.JobOptions(
                    tasks_file=tasks_file, timeout_s=600, live=False, proxies=PROXIES,
                    harness=None if harness == "command" else harness), console)
        finally:
            done.set()
            breaker.join(timeout=120)
            front, members = stack.tier_services()
            for service in (front, *members, ServiceProcess(name="processors", args=(), health_url=None),
                            ServiceProcess(name="ui", args=(), health_url=None)):
                service.stop()
            _compare(kafka, _calls(log), outcome)
            asyncio.run(delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix))
            os.environ.clear()
            os.environ.update(saved)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--calls", type=int, default=8, help="model calls per session (command harness)")
    parser.add_argument("--kill-after", type=float, default=0.4, help="fraction of calls answered before the kill")
    parser.add_argument("--down-s", type=float, default=5.0, help="how long the killed process stays down")
    parser.add_argument("--latency-ms", type=float, default=250.0, help=(
        "the stand-in engine's time to answer: sessions long enough to be cut by the kill"))
    parser.add_argument("--harness", default="command", help="command (a scripted chat client) or a CLI's name")
    parser.add_argument("--keep", action="store_true", help="keep the working folder (logs) afterwards")
    args = parser.parse_args()
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    root = Path(tempfile.mkdtemp(prefix="rollwire-proxy-failover-"))
    bootstrap = os.environ.get("ROLLWIRE_KAFKA_BOOTSTRAP")
    broker: KafkaBroker | None = None
    if bootstrap is None:
        base = KafkaConfig.from_env()
        config = KafkaConfig(version=base.version, cache_dir=base.cache_dir, home=root / "kafka",
                             port=free_port(), controller_port=free_port(), max_message_bytes=base.max_message_bytes)
        broker = KafkaBroker(config)
        broker.start(timeout_s=240)
        bootstrap = config.bootstrap
    try:
        outcome = run(root / "run", bootstrap, tasks=args.tasks, samples=args.samples, calls=args.calls,
                      kill_after=args.kill_after, down_s=args.down_s, harness=args.harness,
                      latency_ms=args.latency_ms)
    finally:
        if broker is not None:
            broker.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.keep:
        print(f"workdir={root}")
    for key, value in asdict(outcome).items():
        if key in ("details", "lost"):
            continue
        print(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}")
    for key, value in outcome.details.items():
        if value:
            print(f"{key}_sample={' | '.join(value)}")
    print(f"lost={outcome.lost}")


if __name__ == "__main__":
    main()
