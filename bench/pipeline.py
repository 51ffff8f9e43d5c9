"""Completion events through the real broker and a real trajectory worker: throughput and latency.

Starts a worker (``python -m deploy.cli processors``, RocksDB tables) on a fresh topic prefix of the
broker at ``ROLLWIRE_KAFKA_BOOTSTRAP`` (default: the project's local one; ``rollwire up`` starts it),
then pushes realistic sessions: ``--turns`` completions each, prompts extending each other (previous
prompt + sampled reply + a tool result, real Qwen token ids), about ``--tokens`` prompt tokens per
completion on average, each session's spec first and its ``session.ended`` once the broker has
acknowledged its calls (as in a deployment). Events are encoded before the clock starts; the bench's
producer and consumer run on the same machine as the broker and the worker.

Two phases: ``flood`` (everything as fast as the producer can send: the worker's capacity,
``events_per_s`` = completion events / (last trajectory received - first event sent)); ``paced`` (at
``--rate`` events/s, or 80% of the flood's figure if that is lower: the latency from a session's end
event being sent to its trajectory being read from ``trajectories``, p50/p99). Before them, side by side,
the same flood through a worker that only counts and acknowledges records
(``ROLLWIRE_PROCESSORS_TRANSPORT_ONLY``): ``transport_only_events_per_s`` is what the producer, the broker
and Faust's consumer allow on this machine with none of the work done.

    python -m bench.pipeline [--sessions N] [--turns T] [--tokens K] [--rate R] [--workers W] [--inline-builds-too]
        [--asyncio-loop-too]

The worker builds sessions in its build processes (``ROLLWIRE_PROCESSORS_BUILD_PROCESSES``, default 1;
their CPU is counted in ``worker_cpu_us_per_completion``, and printed apart); ``--inline-builds-too``
also floods workers that build on their own event loop, in the same run, for comparison;
``--asyncio-loop-too`` workers on asyncio's own event loop instead of uvloop (``ROLLWIRE_PROCESSORS_EVENT_LOOP``).

``ROLLWIRE_BENCH_PYSPY=FILE`` samples the worker with py-spy during the flood (collapsed stacks);
``ROLLWIRE_BENCH_PROFILE=FILE`` profiles it with cProfile instead (see bench/profiled.py).

With the machine full in both floods, throughput follows machine CPU per completion:
``machine_cpu_ratio_if_worker_free`` is the transport-only machine CPU over the flood's with the worker's
share replaced by the transport-only worker's, the most the ratio could be on this machine with a worker
that added nothing (the trajectories written and read and the changelogs stay).

Prints ``name=value`` lines, the key figure last: ``ratio_to_transport_only`` (``events_per_s`` /
``transport_only_events_per_s``, both beside it on the last line, from the same run). Raw aiokafka, not the typed clients:
records are encoded before the clock starts, so the figures are the bare transport's and the worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.machine_cpu import CpuMeter, CpuUse, children, format_use, kafka_broker_pids, process_cpu_s
from bench.workloads import TokenSource, session_completions
from processors.trajectories.topics import prepare_topics
from schemas.codec import encode_event, event_headers
from schemas.envelope import Event
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.topics import Topic
from schemas.transport.admin import delete_topics
from schemas.transport.settings import KafkaSettings

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Record:
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    session_id: str
    is_end: bool = False
    is_completion: bool = False


def _record(kafka: KafkaSettings, event: Event, **flags: bool) -> Record:
    return Record(kafka.registry().name(event.topic), event.key(), encode_event(event), event_headers(event),
                  getattr(event, "session_id"), **flags)


def make_sessions(kafka: KafkaSettings, tag: str, sessions: int, turns: int, tokens: int,
                  seed: int = 0) -> list[list[Record]]:
    """Each session's records in order: spec, completions, end."""
    source = TokenSource(limit_chars=600_000)
    rng = np.random.default_rng(seed)
    # The first prompt is the system prompt + task; later ones grow by ~650 tokens a turn (reply + tool).
    system_tokens = max(200, tokens - 650 * (turns - 1) // 2)
    out = []
    for i in range(sessions):
        session_id = f"{tag}-{i}"
        records = [_record(kafka, SessionSpec(session_id=session_id, task_id=f"task-{i // 8}"))]
        records += [_record(kafka, c, is_completion=True) for c in
                    session_completions(source, rng, session_id=session_id, turns=turns, system_tokens=system_tokens)]
        records.append(_record(kafka, SessionEnded(session_id=session_id, status=SessionStatus.COMPLETED), is_end=True))
        out.append(records)
    return out


def interleave(sessions: list[list[Record]], concurrent: int) -> list[Record]:
    """The order a fleet of ``concurrent`` running sessions would produce: round robin within waves."""
    order: list[Record] = []
    for start in range(0, len(sessions), concurrent):
        wave = sessions[start:start + concurrent]
        for step in range(max(len(s) for s in wave)):
            order += [s[step] for s in wave if step < len(s)]
    return order


class Worker:
    def __init__(self, kafka: KafkaSettings, app_id: str, data_dir: Path, port: int,
                 extra_env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}/health"
        self.sampler: subprocess.Popen | None = None
        env = {**os.environ, **(extra_env or {}), "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap,
               "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix, "ROLLWIRE_PROCESSORS_APP_ID": app_id,
               "ROLLWIRE_PROCESSORS_DATA_DIR": str(data_dir), "ROLLWIRE_PROCESSORS_PORT": str(port),
               "ROLLWIRE_PROCESSORS_LOG_LEVEL": "warning"}
        self.log = (data_dir.parent / f"worker-{port}.log").open("wb")
        # ROLLWIRE_BENCH_PROFILE=FILE profiles the worker (cProfile) during the flood phase only (the paced
        # one with ROLLWIRE_BENCH_PROFILE_PHASE=paced).
        profile = os.environ.get("ROLLWIRE_BENCH_PROFILE")
        prefix = ["-m", "bench.profiled", profile] if profile else []
        self.process = subprocess.Popen([sys.executable, *prefix, "-m", "deploy.cli", "processors"], cwd=ROOT, env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("worker did not become healthy")

    def profiling(self, on: bool, phase: str) -> None:
        if os.environ.get("ROLLWIRE_BENCH_PROFILE_PHASE", "flood") != phase:
            return
        if os.environ.get("ROLLWIRE_BENCH_PROFILE"):
            self.process.send_signal(signal.SIGRTMIN + (3 if on else 4))  # see bench/profiled.py
        sampled = os.environ.get("ROLLWIRE_BENCH_PYSPY")
        if sampled and on:
            # A sampling profile (py-spy, collapsed stacks) of the phase, no tracing overhead: the thread
            # holding the GIL only (a thread preempted inside a send would otherwise count as busy).
            command = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(self.process.pid),
                       "--rate", "200", "--format", "raw", "--output", sampled, "--nonblocking", "--gil"]
            self.sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elif sampled and self.sampler is not None:
            self.sampler.send_signal(signal.SIGINT)
            self.sampler.wait(30)
            self.sampler = None

    def cpu_s(self) -> float:
        """CPU seconds the worker has used so far (user + system), its build processes included."""
        return self.main_cpu_s() + self.builds_cpu_s()

    def main_cpu_s(self) -> float:
        """CPU seconds of the worker's own process (the Faust event loop), from /proc."""
        return process_cpu_s(self.process.pid)

    def builds_cpu_s(self) -> float:
        """CPU seconds of the worker's build processes (its children: processors.trajectories.session_builds)."""
        return sum(process_cpu_s(child) for child in children(self.process.pid))

    def health(self) -> dict:
        return httpx.get(self.url, timeout=5).json()

    def health_ok(self) -> bool:
        try:
            return httpx.get(self.url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Workers:
    """``n`` workers of one app (one consumer group): the partitions are shared between them."""

    def __init__(self, kafka: KafkaSettings, app_id: str, home: Path, port: int, n: int,
                 extra_env: dict[str, str] | None = None) -> None:
        self.workers = [Worker(kafka, app_id, home / f"data-{i}", port + i, extra_env) for i in range(n)]

    def wait_healthy(self, timeout_s: float = 180) -> None:
        # Every member healthy at once: no rebalance going on and every table recovered.
        deadline = time.monotonic() + timeout_s
        while True:
            for worker in self.workers:
                worker.wait_healthy(max(1.0, deadline - time.monotonic()))
            time.sleep(2)
            if all(w.health_ok() for w in self.workers):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not settle")

    def profiling(self, on: bool, phase: str) -> None:
        self.workers[0].profiling(on, phase)

    def cpu_s(self) -> float:
        return sum(w.cpu_s() for w in self.workers)

    def main_cpu_s(self) -> float:
        return sum(w.main_cpu_s() for w in self.workers)

    def health(self) -> dict:
        merged: dict = {}
        for worker in self.workers:
            for key, value in worker.health().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    merged[key] = merged.get(key, 0) + value
        return merged

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


def meter(workers: Workers) -> CpuMeter:
    """The machine's CPU and its parts during a flood: the workers (build processes included), the
    broker, and this process (the producer and the trajectory reader)."""
    return CpuMeter({"worker": lambda: [w.process.pid for w in workers.workers], "broker": kafka_broker_pids,
                     "bench": lambda: [os.getpid()]})


async def send_causally(producer: AIOKafkaProducer, order: list[Record], rate: float | None = None,
                        started: float = 0.0, end_sent: dict[str, float] | None = None) -> None:
    """Send ``order`` (paced at ``rate`` records/s from ``started``, or flat out), each session's end only
    once the broker has acknowledged its calls, as in a deployment: the proxy answers a call's last token
    after its ack, and the gateway writes the end after the harness is done. (The worker relies on that
    order: its input topics are stamped with the broker's append time, schemas.topics.) ``end_sent``:
    when each session's end went out."""
    calls: dict[str, list[asyncio.Future]] = {}
    pending: list[asyncio.Future] = []
    ends: list[asyncio.Task[None]] = []

    async def send_end(record: Record, acks: list[asyncio.Future]) -> None:
        await asyncio.gather(*acks)
        await (await producer.send(record.topic, record.value, key=record.key, headers=record.headers))
        if end_sent is not None:
            end_sent[record.session_id] = time.time()

    for i, record in enumerate(order):
        if rate:
            lag = started + i / rate - time.time()
            if lag > 0:
                await asyncio.sleep(lag)
        if record.is_end:
            ends.append(asyncio.ensure_future(send_end(record, calls.pop(record.session_id, []))))
            continue
        future = await producer.send(record.topic, record.value, key=record.key, headers=record.headers)
        calls.setdefault(record.session_id, []).append(future)
        pending.append(future)
        if len(pending) >= 2000:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending, *ends)


async def run_phase(kafka: KafkaSettings, order: list[Record], rate: float | None, expect: int,
                    timeout_s: float) -> dict[str, float]:
    """Send ``order`` (paced at ``rate`` events/s, or flat out) and read ``expect`` trajectories."""
    producer = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap, acks="all", enable_idempotence=True,
                                compression_type="zstd", max_request_size=kafka.max_message_bytes,
                                linger_ms=5, max_batch_size=512 * 1024)
    consumer = AIOKafkaConsumer(kafka.registry().name(Topic.TRAJECTORIES), bootstrap_servers=kafka.kafka_bootstrap,
                                auto_offset_reset="latest", max_partition_fetch_bytes=kafka.fetch_bytes)
    await producer.start()
    await consumer.start()
    await consumer.seek_to_end()
    end_sent: dict[str, float] = {}
    received: dict[str, float] = {}
    values: dict[str, bytes] = {}  # each session's first trajectory, checked after the clock stops

    async def read() -> None:
        while len(received) < expect:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                now = time.time()
                for r in records:
                    received.setdefault(r.key.decode(), now)
                    values.setdefault(r.key.decode(), r.value)

    reader = asyncio.create_task(read())
    started = time.time()
    try:
        await send_causally(producer, order, rate, started, end_sent)
        sent_all = time.time()
        await asyncio.wait_for(reader, timeout_s)
    finally:
        reader.cancel()
        await producer.stop()
        await consumer.stop()
    completions = sum(r.is_completion for r in order)
    calls: dict[str, int] = {}
    for r in order:
        if r.is_completion:
            calls[r.key.decode()] = calls.get(r.key.decode(), 0) + 1
    # A trajectory built without some of its session's calls (a session judged read up to its end too early).
    incomplete = sum(orjson.loads(value)["stats"]["completions"] != calls[session] for session, value in values.items())
    latencies = np.array([(received[s] - end_sent[s]) * 1000 for s in end_sent if s in received])
    last = max(received.values())
    return {"completions": completions, "trajectories": len(received), "incomplete": incomplete,
            "send_s": sent_all - started,
            "events_per_s": completions / (last - started), "p50_ms": float(np.percentile(latencies, 50)),
            "p99_ms": float(np.percentile(latencies, 99)), "max_ms": float(latencies.max())}


async def transport_ceiling(args: argparse.Namespace) -> tuple[float, list[float], CpuUse]:
    """Completions/s when the worker only counts and acknowledges records (ROLLWIRE_PROCESSORS_TRANSPORT_ONLY):
    the same flood through the same producer, broker and Faust consumer, with none of the work done; and
    the machine's CPU meanwhile (the worker's among it). The best of ``--transport-rounds`` floods (fresh
    sessions each): the first on a fresh topic runs slower (the broker warming up), and the ceiling
    should be what the transport can do, not what it did once."""
    kafka = KafkaSettings(topic_prefix=f"bench{uuid.uuid4().hex[:8]}.")
    await prepare_topics(kafka, "processors")
    home = Path(tempfile.mkdtemp(prefix="rollwire-bench-pipeline-"))
    workers = Workers(kafka, "processors", home, args.port + 50, args.workers,
                      {"ROLLWIRE_PROCESSORS_TRANSPORT_ONLY": "true"})
    rounds: list[tuple[float, CpuUse]] = []
    cpu = meter(workers)
    try:
        workers.wait_healthy()
        counted = 0
        for i in range(args.transport_rounds):
            order = interleave(make_sessions(kafka, f"ceiling{i}", args.sessions, args.turns, args.tokens,
                                             seed=3 + 10 * i), args.concurrent)
            producer = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap, acks="all",
                                        enable_idempotence=True, compression_type="zstd",
                                        max_request_size=kafka.max_message_bytes, linger_ms=5,
                                        max_batch_size=512 * 1024)
            await producer.start()
            machine0 = cpu.sample()
            started = time.time()
            try:
                await send_causally(producer, order)
            finally:
                await producer.stop()
            counted += len(order)
            while workers.health().get("records", 0) < counted:
                await asyncio.sleep(0.05)
            completions = sum(r.is_completion for r in order)
            rounds.append((completions / (time.time() - started), cpu.since(machine0)))
        best = max(rounds, key=lambda r: r[0])
        return best[0], [r[0] for r in rounds], best[1]
    finally:
        workers.stop()
        shutil.rmtree(home, ignore_errors=True)
        await delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix)


async def variant_flood(args: argparse.Namespace, env: dict[str, str], port_offset: int,
                        seed: int) -> tuple[float, float, float]:
    """The flood through workers that differ from the measured ones by ``env`` (say, no build
    processes, or asyncio's own event loop): completions/s, the worker's CPU per completion and that of
    its event loop's process alone."""
    kafka = KafkaSettings(topic_prefix=f"bench{uuid.uuid4().hex[:8]}.")
    await prepare_topics(kafka, "processors")
    home = Path(tempfile.mkdtemp(prefix="rollwire-bench-pipeline-"))
    workers = Workers(kafka, "processors", home, args.port + port_offset, args.workers, env)
    try:
        sessions = make_sessions(kafka, f"variant{seed}", args.sessions, args.turns, args.tokens, seed=seed)
        workers.wait_healthy()
        cpu0, main0 = workers.cpu_s(), workers.main_cpu_s()
        flood = await run_phase(kafka, interleave(sessions, args.concurrent), None, len(sessions), timeout_s=600)
        return (flood["events_per_s"], (workers.cpu_s() - cpu0) / flood["completions"],
                (workers.main_cpu_s() - main0) / flood["completions"])
    finally:
        workers.stop()
        shutil.rmtree(home, ignore_errors=True)
        await delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix)


async def bench(args: argparse.Namespace) -> None:
    ceiling, ceiling_rounds, ceiling_use = await transport_ceiling(args)
    inline = await variant_flood(args, {"ROLLWIRE_PROCESSORS_BUILD_PROCESSES": "0"}, 70, 4) \
        if args.inline_builds_too else None
    stdlib_loop = await variant_flood(args, {"ROLLWIRE_PROCESSORS_EVENT_LOOP": "asyncio"}, 90, 5) \
        if args.asyncio_loop_too else None
    kafka = KafkaSettings(topic_prefix=f"bench{uuid.uuid4().hex[:8]}.")
    await prepare_topics(kafka, "processors")
    home = Path(tempfile.mkdtemp(prefix="rollwire-bench-pipeline-"))
    worker = Workers(kafka, "processors", home, args.port, args.workers)
    try:
        t0 = time.time()
        flood_sessions = make_sessions(kafka, "flood", args.sessions, args.turns, args.tokens, seed=1)
        paced_sessions = make_sessions(kafka, "paced", args.sessions, args.turns, args.tokens, seed=2)
        completions = [r for s in flood_sessions for r in s if r.is_completion]
        print(f"generate_s={time.time() - t0:.1f}")
        print(f"completion_bytes_mean={np.mean([len(r.value) for r in completions]):.0f}")
        worker.wait_healthy()
        cpu = meter(worker)
        cpu0, main0, machine0 = worker.cpu_s(), worker.main_cpu_s(), cpu.sample()
        worker.profiling(True, "flood")
        flood = await run_phase(kafka, interleave(flood_sessions, args.concurrent), None, len(flood_sessions),
                                timeout_s=600)
        flood_use = cpu.since(machine0)
        flood_cpu_s, flood_main_cpu_s = worker.cpu_s() - cpu0, worker.main_cpu_s() - main0
        worker.profiling(False, "flood")
        rate = min(args.rate, 0.8 * flood["events_per_s"])
        events_per_completion = (args.turns + 2) / args.turns
        cpu0 = worker.cpu_s()
        worker.profiling(True, "paced")
        paced = await run_phase(kafka, interleave(paced_sessions, args.concurrent), rate * events_per_completion,
                                len(paced_sessions), timeout_s=600)
        paced_cpu_s = worker.cpu_s() - cpu0
        worker.profiling(False, "paced")
        health = worker.health()
    finally:
        worker.stop()
        shutil.rmtree(home, ignore_errors=True)
        await delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix)
    print(f"sessions={args.sessions} turns={args.turns} concurrent_sessions={args.concurrent} workers={args.workers} "
          f"build_processes={os.environ.get('ROLLWIRE_PROCESSORS_BUILD_PROCESSES', '1')} "
          f"event_loop={os.environ.get('ROLLWIRE_PROCESSORS_EVENT_LOOP', 'uvloop')}")
    print(f"flood_completions={flood['completions']} flood_trajectories={flood['trajectories']}")
    print(f"flood_send_s={flood['send_s']:.1f}")
    # CPU per completion is what this machine's load (other processes) does not distort much.
    print(f"flood_worker_cpu_s={flood_cpu_s:.1f}")
    # The worker's event loop (Faust's consumer, the tables, intake) and its build processes.
    print(f"worker_main_cpu_us_per_completion={flood_main_cpu_s / flood['completions'] * 1e6:.0f}")
    print(f"worker_builds_cpu_us_per_completion={(flood_cpu_s - flood_main_cpu_s) / flood['completions'] * 1e6:.0f}")
    print(f"worker_cpu_us_per_completion={flood_cpu_s / flood['completions'] * 1e6:.0f}")
    print(f"transport_only_rounds_events_per_s={','.join(f'{rate:.0f}' for rate in ceiling_rounds)}")
    if inline is not None:
        print(f"inline_builds_events_per_s={inline[0]:.0f} inline_builds_worker_cpu_us_per_completion={inline[1] * 1e6:.0f}")
    if stdlib_loop is not None:
        print(f"asyncio_loop_events_per_s={stdlib_loop[0]:.0f} "
              f"asyncio_loop_worker_cpu_us_per_completion={stdlib_loop[1] * 1e6:.0f} "
              f"asyncio_loop_worker_main_cpu_us_per_completion={stdlib_loop[2] * 1e6:.0f}")
    # The whole machine during the best transport-only flood and during the flood: how full it was and
    # the CPU per completion of each part. With the machine full in both, their ratio of machine CPU per
    # completion bounds the throughput ratio this machine allows, however the work is scheduled.
    flooded = int(flood["completions"])
    for line in format_use("transport_only_", ceiling_use, flooded, "completion"):
        print(line)
    for line in format_use("flood_", flood_use, flooded, "completion"):
        print(line)
    machine_ratio = ceiling_use.machine_s / flood_use.machine_s if flood_use.machine_s > 0 else 0.0
    print(f"machine_cpu_ratio_transport_only_to_flood={machine_ratio:.2f}")
    # The same ratio had the worker cost no more than the transport-only one: what the job's own I/O
    # (the trajectories written and read, the tables' changelogs: the broker's and the bench's share of
    # the flood) leaves of the ratio on this machine, however cheap the worker's handling were.
    free_worker_s = flood_use.machine_s - flood_use.named_s["worker"] + ceiling_use.named_s["worker"]
    print(f"machine_cpu_ratio_if_worker_free={ceiling_use.machine_s / free_worker_s if free_worker_s > 0 else 0.0:.2f}")
    print(f"flood_end_to_trajectory_p99_ms={flood['p99_ms']:.0f}")
    print(f"paced_rate_completions_per_s={rate:.0f}")
    print(f"paced_events_per_s={paced['events_per_s']:.0f}")
    print(f"paced_worker_cpu_us_per_completion={paced_cpu_s / paced['completions'] * 1e6:.0f}")
    print(f"end_to_trajectory_p50_ms={paced['p50_ms']:.0f}")
    print(f"end_to_trajectory_max_ms={paced['max_ms']:.0f}")
    # Calls that reached the worker after their session was built (missing from its trajectory): 0.
    print(f"worker_dead_lettered={health.get('dead_lettered')} worker_read_back={health.get('read_back')} "
          f"worker_builds={health.get('trajectories')} worker_late={health.get('late')} "
          f"worker_calls_after_build={health.get('calls_after_build')} worker_build_failures={health.get('build_failures')} "
          f"worker_ends_asked={health.get('ends_asked')}")
    # Trajectories whose call count is not their session's (checked by reading each one): 0.
    print(f"flood_incomplete_trajectories={flood['incomplete']} paced_incomplete_trajectories={paced['incomplete']}")
    print(f"end_to_trajectory_p99_ms={paced['p99_ms']:.0f}")
    # The key figure last, the two throughputs it is the ratio of beside it (same run, same machine).
    print(f"events_per_s={flood['events_per_s']:.0f} transport_only_events_per_s={ceiling:.0f} "
          f"ratio_to_transport_only={flood['events_per_s'] / ceiling:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1500)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2000, help="mean prompt tokens per completion")
    parser.add_argument("--concurrent", type=int, default=64, help="sessions running at once")
    parser.add_argument("--rate", type=float, default=2000.0, help="paced phase: completions per second")
    parser.add_argument("--port", type=int, default=18191)
    parser.add_argument("--workers", type=int, default=1, help="worker processes sharing the partitions")
    parser.add_argument("--transport-rounds", type=int, default=2,
                        help="transport-only floods; the best is the ceiling the ratio is taken to")
    parser.add_argument("--inline-builds-too", action="store_true",
                        help="also flood workers that build on their event loop (no build processes), side by side")
    parser.add_argument("--asyncio-loop-too", action="store_true",
                        help="also flood workers on asyncio's own event loop (not uvloop), side by side")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
