"""A broker dies mid-rollout and nothing is lost: a whole rollout on a three-node cluster.

Starts a three-node KRaft cluster (deploy/kafka_cluster.py, free ports, a temporary home, topics with three
replicas and two in sync) and runs the main job (deploy/job.py: proxy, trajectory worker, rollout server,
gateway node, the ``tests`` evaluator, groups worker) over the stand-in engine, with many short sessions of
a ``command`` harness. The harness makes ``--calls`` chat calls, each carrying a nonce, retries what the
provider calls retryable (429, 5xx, a refused connection) for up to two minutes as real SDKs do, and
writes one line per call to a shared log: answered or not, attempts, errors, seconds.

With the fault: once ``--kill-after`` of the calls are answered, the node leading the most `completions`
partitions is SIGKILLed, and started again ``--down-s`` later; ``--kill-worker`` also starts a second
trajectory worker and SIGKILLs it while the node is away. Then it reads the log back and compares:

- every call the harnesses saw answered has exactly one recorded completion (``ok``) with its nonce:
  ``lost`` counts answered calls without one, ``duplicated_completions`` those with more;
- every ended session exactly one trajectory (``missing_trajectories``, ``duplicated_trajectories``:
  distinct trajectory events for one session), every task exactly one group (``missing_groups``,
  ``duplicated_groups``);
- a trainer feed (sinks/feed.py, its own consumer group, acknowledging every batch, retrying a refused
  acknowledgement as a trainer would) reads `groups` throughout: ``feed_groups`` distinct groups reached
  it, ``feed_repeated_groups`` came more than once;
- ``longest_wait_s``: the longest a harness waited for one call (errors and retries included), beside the
  fault-free run's (``--baseline``, default on: the same tasks first without a fault).

    python -m bench.failover [--tasks 6] [--samples 3] [--calls 6] [--down-s 15] [--kill-worker]
                             [--no-baseline]

Prints ``name=value`` lines, the key figure last: ``lost`` (the goal is 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

from rich.console import Console

from bench.serving import free_port, serve
from tests.support.standin_engine import StandinConfig, create_app as create_standin
from deploy import job as rollout_job
from deploy.kafka import KafkaConfig
from deploy.kafka_cluster import KafkaCluster
from deploy.services import ServiceProcess
from schemas.completions import Completion
from schemas.groups import Group
from schemas.sessions import SessionEnded
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, KafkaAdmin, KafkaSettings, delete_topics, ensure_topics

CLUSTER_HEAP = "-Xms128m -Xmx384m"
NONCE = re.compile(r"\[call ([0-9a-f]{32})\]")

HARNESS = r'''
import json, os, sys, time, urllib.error, urllib.request, uuid
base_url, api_key, model, session_id, log_path, calls = sys.argv[1:7]
RETRYABLE = {429, 500, 502, 503, 504, 529}
messages = [{"role": "system", "content": "You fix bugs."}]
for turn in range(int(calls)):
    nonce = uuid.uuid4().hex
    messages.append({"role": "user", "content": f"step {turn} [call {nonce}]"})
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 8}).encode()
    started, wall, attempts, errors, reply = time.monotonic(), time.time(), 0, [], None
    while reply is None and time.monotonic() - started < 120:
        attempts += 1
        request = urllib.request.Request(base_url + "/chat/completions", data=body, headers={
            "Authorization": "Bearer " + api_key, "Content-Type": "application/json"})
        try:
            reply = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]
        except urllib.error.HTTPError as exc:
            errors.append(exc.code)
            if exc.code not in RETRYABLE:
                break
        except (urllib.error.URLError, OSError) as exc:
            errors.append(type(exc).__name__)
        if reply is None:
            time.sleep(min(4.0, 0.25 * 2 ** min(attempts, 4)))
    line = {"session_id": session_id, "turn": turn, "nonce": nonce, "answered": reply is not None,
            "attempts": attempts, "errors": errors, "seconds": time.monotonic() - started, "at": wall}
    with open(log_path, "a") as log:
        log.write(json.dumps(line) + "\n")
    if reply is None:
        sys.exit(3)
    messages += [{"role": "assistant", "content": reply.get("content") or ""}]
if session_id.endswith("-s0"):
    open("calc.py", "w").write("def add(a, b):\n    return a + b\n")
'''


class CallLine(TypedDict):
    """One line of the harnesses' log: one model call as the harness saw it."""

    session_id: str
    turn: int
    nonce: str
    answered: bool
    attempts: int
    errors: list[int | str]
    seconds: float
    at: float


@dataclass
class Fault:
    """What to break, and when."""

    kill_after: float = 0.3
    """Fraction of the expected calls answered before the node is killed."""
    down_s: float = 15.0
    kill_worker: bool = False


@dataclass
class Outcome:
    """One run's figures."""

    answered: int = 0
    unanswered: int = 0
    recorded: int = 0
    lost: int = 0
    duplicated_completions: int = 0
    harness_errors: int = 0
    longest_wait_s: float = 0.0
    sessions_ended: int = 0
    missing_trajectories: int = 0
    duplicated_trajectories: int = 0
    trajectory_copies: int = 0
    """Trajectory records beyond one per session, same event id included (consumers drop those by id)."""
    tasks: int = 0
    missing_groups: int = 0
    duplicated_groups: int = 0
    feed_groups: int = 0
    feed_repeated_groups: int = 0
    feed_ack_retries: int = 0
    job_exit_code: int = -1
    unreplicated_topics: int = 0
    """Topics of the run (the workers' own included) with fewer than three replicas."""
    killed_node: int = 0
    killed_worker: bool = False
    down_at_s: float = 0.0
    details: dict[str, list[str]] = field(default_factory=dict)


def _tasks_file(work: Path, tasks: int, samples: int, calls: int, log: Path) -> Path:
    repo = work / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "test_calc.py").write_text("import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
                                       "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    script = work / "harness.py"
    script.write_text(HARNESS)
    path = work / "tasks.jsonl"
    with path.open("w") as out:
        for i in range(tasks):
            out.write(json.dumps({
                "task_id": f"failover-{i}", "instruction": "fix calc.py", "num_samples": samples, "timeout_s": 240,
                "runtime": {"kind": "local", "repo": str(repo)},
                "agent": {"harness": "command", "command": f"{sys.executable} {script} {{base_url}} {{api_key}} "
                                                           f"{{model}} {{session_id}} {log} {calls}"},
                "evaluator": {"name": "tests", "settings": {"command": f"{sys.executable} -m unittest -q",
                                                            "timeout_s": 60}}}) + "\n")
    return path


def _calls(log: Path) -> list[CallLine]:
    try:
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


async def _leader_of_most(kafka: KafkaSettings, topic: Topic) -> int:
    async with KafkaAdmin(kafka.kafka_bootstrap) as admin:
        leaders = collections.Counter(p.leader for p in await admin.partitions(kafka.registry().name(topic)))
    return leaders.most_common(1)[0][0]


def _second_worker(kafka: KafkaSettings, home: Path) -> ServiceProcess:
    """Another trajectory worker in the same consumer group (its own port and state folder)."""
    port = free_port()
    env = {"ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap, "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix,
           "ROLLWIRE_SESSION_PARTITIONS": str(kafka.session_partitions),
           "ROLLWIRE_TASK_PARTITIONS": str(kafka.task_partitions),
           "ROLLWIRE_REPLICATION_FACTOR": str(kafka.replication_factor),
           "ROLLWIRE_MIN_INSYNC_REPLICAS": str(kafka.min_insync_replicas),
           "ROLLWIRE_PROCESSORS_PORT": str(port), "ROLLWIRE_PROCESSORS_DATA_DIR": str(home / "processors-2-data")}
    return ServiceProcess(name="processors-2", args=("processors",), health_url=f"http://127.0.0.1:{port}/health",
                          env=env, home=home)


def _break_things(cluster: KafkaCluster, kafka: KafkaSettings, log: Path, expected_calls: int, fault: Fault,
                  worker: ServiceProcess | None, outcome: Outcome, done: threading.Event) -> None:
    """Wait for ``kill_after`` of the calls, kill the node leading most `completions` partitions (and the
    second worker), start the node again ``down_s`` later."""
    started = time.monotonic()
    while not done.is_set() and sum(1 for c in _calls(log) if c["answered"]) < fault.kill_after * expected_calls:
        time.sleep(0.2)
    if done.is_set():
        return
    victim = asyncio.run(_leader_of_most(kafka, Topic.COMPLETIONS))
    cluster.kill(victim)
    outcome.killed_node, outcome.down_at_s = victim, time.monotonic() - started
    if worker is not None:
        time.sleep(min(3.0, fault.down_s / 2))
        pid = worker.pid()
        if pid is not None:
            os.kill(pid, 9)
            outcome.killed_worker = True
    time.sleep(fault.down_s)
    cluster.restart(victim)


def _trainer_feed(kafka: KafkaSettings, delivered: collections.Counter[str], outcome: Outcome,
                  done: threading.Event) -> None:
    """Train on nothing, but read every group as a trainer does, acknowledging each batch; return once the
    job is done and no group has come for a while."""
    from sinks.feed import BatchConfig, FeedError, ReadConfig, TrainerFeed

    with TrainerFeed(ReadConfig(group_id=f"{kafka.topic_prefix}trainer"),
                     BatchConfig(token_budget=1 << 16, tensors="numpy", linger_s=0.5, idle_timeout_s=10.0),
                     settings=kafka) as feed:
        while True:
            try:
                batch = next(feed)
            except StopIteration:
                if done.is_set():
                    return
                continue
            delivered.update(set(batch.group_event_ids))
            for _ in range(120):
                try:
                    feed.ack(batch)
                    break
                except FeedError:
                    outcome.feed_ack_retries += 1
                    time.sleep(1.0)


async def _unreplicated(kafka: KafkaSettings) -> list[str]:
    async with KafkaAdmin(kafka.kafka_bootstrap) as admin:
        names = sorted(n for n in await admin.topic_names() if n.startswith(kafka.topic_prefix))
        return [n for n in names if min(len(p.replicas) for p in await admin.partitions(n)) < 3]


async def _read_all(kafka: KafkaSettings, topics: list[Topic]) -> list[object]:
    events: list[object] = []
    async with EventConsumer(kafka, topics, group_id=None, dedupe_window=0, dead_letters=False) as consumer:
        ends = await consumer.end_offsets(await consumer.wait_for_assignment())
        while not await consumer.caught_up(ends):
            events.extend(r.event for r in await consumer.getmany(timeout_ms=500))
    return events


def _compare(kafka: KafkaSettings, calls: list[CallLine], outcome: Outcome) -> None:
    events = asyncio.run(_read_all(kafka, [Topic.COMPLETIONS, Topic.SESSION_EVENTS, Topic.TRAJECTORIES,
                                           Topic.GROUPS]))
    recorded: collections.Counter[str] = collections.Counter()
    seen_ids: set[str] = set()
    trajectories: dict[str, set[str]] = collections.defaultdict(set)
    trajectory_records: collections.Counter[str] = collections.Counter()
    trajectory_shapes: dict[str, dict[str, str]] = collections.defaultdict(dict)
    groups: dict[str, set[str]] = collections.defaultdict(set)
    ended: set[str] = set()
    for event in events:
        if isinstance(event, Completion) and event.status == "ok" and event.event_id not in seen_ids:
            nonces = NONCE.findall(event.request.model_dump_json())
            if nonces:
                recorded[nonces[-1]] += 1
        elif isinstance(event, Trajectory):
            trajectories[event.session_id].add(event.event_id)
            trajectory_records[event.session_id] += 1
            trajectory_shapes[event.session_id][event.event_id] = _shape(event)
        elif isinstance(event, Group):
            groups[event.task_id].add(event.event_id)
        elif isinstance(event, SessionEnded):
            ended.add(event.session_id)
        seen_ids.add(event.event_id)  # type: ignore[attr-defined]
    answered = [c for c in calls if c["answered"]]
    outcome.answered = len(answered)
    outcome.unanswered = len(calls) - len(answered)
    outcome.recorded = sum(recorded.values())
    lost = [c["nonce"] for c in answered if recorded[c["nonce"]] == 0]
    outcome.lost = len(lost)
    outcome.duplicated_completions = sum(1 for c in answered if recorded[c["nonce"]] > 1)
    outcome.harness_errors = sum(len(c["errors"]) for c in calls)
    outcome.longest_wait_s = max((c["seconds"] for c in calls), default=0.0)
    outcome.sessions_ended = len(ended)
    outcome.missing_trajectories = sum(1 for s in ended if not trajectories.get(s))
    outcome.duplicated_trajectories = sum(1 for ids in trajectories.values() if len(ids) > 1)
    outcome.trajectory_copies = sum(n - 1 for n in trajectory_records.values())
    task_ids = {s.rsplit("-s", 1)[0] for s in ended}
    outcome.tasks = len(task_ids)
    outcome.missing_groups = sum(1 for t in task_ids if not groups.get(t))
    outcome.duplicated_groups = sum(1 for ids in groups.values() if len(ids) > 1)
    unreplicated = asyncio.run(_unreplicated(kafka))
    outcome.unreplicated_topics = len(unreplicated)
    outcome.details = {"lost": lost[:10], "unreplicated_topics": unreplicated[:10],
                       "sessions_without_trajectory": sorted(s for s in ended if not trajectories.get(s))[:10],
                       "tasks_without_group": sorted(t for t in task_ids if not groups.get(t))[:10],
                       "duplicated_trajectories": [f"{s}: " + " | ".join(shapes.values())
                                                   for s, shapes in trajectory_shapes.items() if len(shapes) > 1][:10]}


def _shape(trajectory: Trajectory) -> str:
    """What tells two builds of one session apart: what they were built from and when."""
    completions = [c for t in trajectory.traces for c in t.completion_ids]
    return (f"{trajectory.event_id[:8]} partial={trajectory.partial} status={trajectory.session_status} "
            f"traces={len(trajectory.traces)} completions={len(set(completions))} "
            f"sequences={sorted({s for t in trajectory.traces for s in t.sequences})} "
            f"problems={len(trajectory.stats.problems)}")


def run_rollout(cluster: KafkaCluster, work: Path, *, tasks: int, samples: int, calls: int,
                fault: Fault | None, latency_ms: float = 100.0) -> Outcome:
    """One rollout of ``tasks`` × ``samples`` sessions on ``cluster``, with ``fault`` (None: fault-free), on
    fresh topics; returns the comparison. Sets this process's ROLLWIRE_* environment for the job."""
    work.mkdir(parents=True, exist_ok=True)
    home, log = work / "home", work / "calls.jsonl"
    tasks_file = _tasks_file(work, tasks, samples, calls, log)
    kafka = cluster.settings(KafkaSettings(topic_prefix=f"f{uuid.uuid4().hex[:8]}.", session_partitions=6,
                                           task_partitions=3))
    outcome = Outcome()
    saved = dict(os.environ)
    with serve(create_standin(StandinConfig(latency_ms=latency_ms, reply_tokens=8))) as engine_url:
        os.environ.update({
            "ROLLWIRE_HOME": str(home), "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap,
            "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix, "ROLLWIRE_ENGINE_URL": engine_url,
            "ROLLWIRE_REPLICATION_FACTOR": str(kafka.replication_factor),
            "ROLLWIRE_MIN_INSYNC_REPLICAS": str(kafka.min_insync_replicas),
            "ROLLWIRE_SESSION_PARTITIONS": str(kafka.session_partitions),
            "ROLLWIRE_TASK_PARTITIONS": str(kafka.task_partitions),
            "ROLLWIRE_PROXY_PORT": str(free_port()), "ROLLWIRE_PROCESSORS_PORT": str(free_port()),
            "ROLLWIRE_PROCESSORS_STORE": "memory", "ROLLWIRE_ROLLOUT_PORT": str(free_port()),
            "ROLLWIRE_GATEWAY_PORT": str(free_port()), "ROLLWIRE_GROUPS_PORT": str(free_port()),
            "ROLLWIRE_GROUPS_STORE": "memory",
            # A dead worker's partitions move after this long (the default, 30 s, only makes the run longer).
            "ROLLWIRE_PROCESSORS_SESSION_TIMEOUT_S": "10"})
        worker = _second_worker(kafka, home) if fault is not None and fault.kill_worker else None
        done = threading.Event()
        breaker: threading.Thread | None = None
        delivered: collections.Counter[str] = collections.Counter()
        trainer = threading.Thread(target=_trainer_feed, args=(kafka, delivered, outcome, done), daemon=True)
        try:
            asyncio.run(ensure_topics(kafka))
            if worker is not None:
                worker.start(timeout_s=180)
            trainer.start()
            if fault is not None:
                breaker = threading.Thread(target=_break_things, args=(cluster, kafka, log, tasks * samples * calls,
                                                                       fault, worker, outcome, done), daemon=True)
                breaker.start()
            with (work / "job.log").open("w") as job_log:
                console = Console(file=job_log, width=200, color_system=None)
                outcome.job_exit_code = rollout_job.run_job(rollout_job.JobOptions(
                    tasks_file=tasks_file, timeout_s=600, live=False), console)
        finally:
            done.set()
            if breaker is not None:
                breaker.join()
            if trainer.ident is not None:  # started (set-up may have failed before)
                trainer.join(timeout=120)
            outcome.feed_groups = len(delivered)
            outcome.feed_repeated_groups = sum(1 for n in delivered.values() if n > 1)
            health = _save_health(work, [os.environ["ROLLWIRE_PROCESSORS_PORT"]]
                         + ([worker.health_url.rsplit(":", 1)[1].split("/")[0]] if worker and worker.health_url else []))
            for name in ("proxy", "processors", "ui"):  # the base stack stays up after a job: stop it here
                ServiceProcess(name=name, args=(), health_url=None).stop()
            if worker is not None:
                worker.stop()
            cluster.start(timeout_s=180)  # every node up again before reading back
            _compare(kafka, _calls(log), outcome)
            outcome.details["worker_health"] = health
            asyncio.run(delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix))
            os.environ.clear()
            os.environ.update(saved)
    return outcome


def _save_health(work: Path, ports: list[str]) -> list[str]:
    """Keep the trajectory workers' health counters beside the run's logs (what to read when one is off);
    returns them too, for the outcome's details."""
    import httpx

    bodies = []
    for port in ports:
        try:
            body = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).text
        except httpx.HTTPError as exc:
            body = repr(exc)
        (work / f"processors-{port}-health.json").write_text(body)
        bodies.append(body)
    return bodies


def start_cluster(root: Path) -> KafkaCluster:
    base = KafkaConfig.from_env()
    config = KafkaConfig(version=base.version, cache_dir=base.cache_dir, home=root / "kafka", heap=CLUSTER_HEAP,
                         max_message_bytes=base.max_message_bytes)
    cluster = KafkaCluster(config, 3, [(free_port(), free_port()) for _ in range(3)])
    cluster.start(timeout_s=240)
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--calls", type=int, default=6, help="model calls per session")
    parser.add_argument("--kill-after", type=float, default=0.3, help="fraction of calls answered before the kill")
    parser.add_argument("--down-s", type=float, default=15.0, help="how long the killed node stays down")
    parser.add_argument("--kill-worker", action="store_true", help="also run and kill a second trajectory worker")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the fault-free run")
    parser.add_argument("--keep", action="store_true", help="keep the working folder (logs) afterwards")
    args = parser.parse_args()
    # The clients in this process (the trainer feed, the read-back) log every failed fetch from the dead node.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    root = Path(tempfile.mkdtemp(prefix="rollwire-failover-"))
    cluster = start_cluster(root)
    runs: dict[str, Outcome] = {}
    try:
        if args.baseline:
            runs["baseline"] = run_rollout(cluster, root / "baseline", tasks=args.tasks, samples=args.samples,
                                           calls=args.calls, fault=None)
        runs["failover"] = run_rollout(cluster, root / "failover", tasks=args.tasks, samples=args.samples,
                                       calls=args.calls, fault=Fault(args.kill_after, args.down_s, args.kill_worker))
    finally:
        cluster.stop(timeout_s=20)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.keep:
        print(f"workdir={root}")
    failover = runs["failover"]
    for name, outcome in runs.items():
        for key, value in asdict(outcome).items():
            if key != "details" and not (name == "failover" and key == "lost"):
                print(f"{name}_{key}={value:.2f}" if isinstance(value, float) else f"{name}_{key}={value}")
        for key, value in outcome.details.items():
            if value and key != "worker_health":  # kept beside the logs (--keep)
                print(f"{name}_{key}_sample={','.join(value)}")
    if "baseline" in runs:
        print(f"longest_wait_ratio={failover.longest_wait_s / max(runs['baseline'].longest_wait_s, 1e-3):.1f}")
    print(f"completions_answered={failover.answered}")
    print(f"completions_recorded={failover.recorded}")
    print(f"duplicated_trajectories={failover.duplicated_trajectories}")
    print(f"longest_wait_s={failover.longest_wait_s:.2f}")
    print(f"lost={failover.lost}")


if __name__ == "__main__":
    main()
