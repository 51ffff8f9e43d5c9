"""What capture costs a harness: the stand-in engine called directly and through the proxy, side by side.

One run starts the project's Kafka (or uses ``ROLLWIRE_KAFKA_BOOTSTRAP``), the stand-in engine (fixed
20 ms latency, recorded vLLM stream shapes, about 4 bytes per token), and the proxy with durable capture
(every reply's end waits for Kafka's ack). N concurrent clients stream realistic 30–50 KB harness
requests, rounds alternating between the paths so that all see the same machine noise, each round started
once the machine is at rest (``quiet_wait_*``: how long that took). With ``--peers``
the paths also include a bare nginx reverse proxy and LiteLLM's proxy in front of the same stand-in
(:mod:`bench.peers`; one that is not installed is skipped with the reason); with ``--capture-floor`` two
bare relays that keep rollwire's one promise and nothing else, each stream's end held until the broker has
rollwire's own event of the call (:mod:`bench.capture_floor`: ``floor_whole`` writes it at the end,
``floor_early`` its prompt part at the first read and the rest at the end); with ``--baseline-tree DIR``
also the proxy of another source tree (an earlier commit), so that a change is measured against what it
changed under the same machine noise. With ``--proxies 1,2`` also a proxy tier of each size N, path
``proxies_N``: N ``rollwire proxy`` processes (``proxy-0`` ..., each its ``ROLLWIRE_PROXY_INSTANCE``, on
topics of their own) behind the real HAProxy front, its configuration written by deploy/proxy_front.py's
writer and HAProxy run as ``rollwire proxy-front`` runs it. Each client's session is addressed by its path
(``/s/{session_id}/v1``, the base URL the front's own session API hands out), so the front spreads
the sessions over the processes (and keeps each on one) as it does a rollout's. ``proxies_1`` is the single proxy
measured directly (path ``through``, the same process and rounds): with N = 1 the proxy listens on its
address itself and no HAProxy runs.

Prints: direct latency percentiles (time to the end of the stream); per peer its added latency at p50
and p99 and its throughput ratio to direct; rollwire's (``through``) the same, the mean of each proxy
stage per call from its ``/metrics`` (parse, upstream wait, relay, capture: the wait for Kafka's ack)
with the ack's share of the added p50, the part of the added p50 that falls before the first token
(``added_first_token_p50_ms``: the request read, parsed and sent on; the rest is the relay and the ack), and rollwire's added p50 over each peer's. Key figure last:
rollwire's ``added_p50_ms``. With ``--proxies``, each tier's figures as well (latencies, its processes' and
its front's CPU, the calls each process served, branch restores, the stage means summed over its processes:
the part of the call claim's time a call still waited for falls in ``upstream_wait``), then per N ``proxies_N_added_p50_ms``, ``proxies_N_added_p99_ms``
and ``proxies_N_over_floor`` (its added p50 over ``floor_whole``'s in the same run, with
``--capture-floor``); the key figure last is then the largest N's ``proxies_N_over_floor`` (without
``--capture-floor``: its ``proxies_N_added_p50_ms``).

    python -m bench.proxy_overhead [--peers] [--capture-floor] [--baseline-tree DIR] [--proxies 1,2] [--concurrency 64]
        [--rounds 4] [--requests-per-client 2] [--token-interval-ms 8] [--token-api]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson

from bench.harness_requests import harness_requests
from bench.capture_floor import save_records
from bench.kafka_floor import KafkaFloor, read_records
from bench.machine_cpu import CpuMeter, kafka_broker_pids, process_cpu_s
from bench.peers import Peer, PeerMissing, start_litellm, start_nginx
from deploy.kafka import KafkaBroker, KafkaConfig
from deploy.proxy_front import (BACKEND, HEALTH_PATH, STATS_PATH, Backend, FrontConfig, haproxy_binary, member_name,
                                server_timeout_s, write_config)
from proxy.capture import settle_compression
from proxy.settings import ProxySettings
from schemas.topics import Topic
from schemas.transport import KafkaSettings, broker_answers, delete_topics, ensure_topics


async def _quiet(meter: CpuMeter, busy_below: float = 0.15, window_s: float = 0.1, limit_s: float = 3.0) -> float:
    """Wait until the machine has been quiet for a window (at most ``limit_s``); returns the wait.

    Each path's round starts on a machine at rest: a peer's own after-work (LiteLLM went on spending CPU
    after its replies were done) would otherwise fall on the round after it, whatever path that is."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        sample = meter.sample()
        await asyncio.sleep(window_s)
        if meter.since(sample).busy < busy_below:
            break
    return time.monotonic() - started


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(args: list[str], env: dict[str, str], log: str, cwd: str | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *args], env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, cwd=cwd)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a child: SIGTERM, then SIGKILL if it has not gone within 10 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _wait_http(url: str, timeout_s: float = 60, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: its process exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def _one(client: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> tuple[float, float]:
    """Seconds to the stream's end and to its first data line."""
    start = time.perf_counter()
    try:
        return await _timed_stream(client, url, body, headers, start)
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"{url}: {exc!r}") from exc


async def _timed_stream(client: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                        start: float) -> tuple[float, float]:
    first: float | None = None
    async with client.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status} {(await response.read())[:300]!r}")
        done = False
        async for line in response.content:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter()
            if line.rstrip(b"\r\n") == b"data: [DONE]":
                done = True
        if not done or first is None:
            raise RuntimeError(f"{url}: stream ended without [DONE]")
    return time.perf_counter() - start, first - start


async def _round(targets: list[tuple[str, dict[str, str]]], bodies: list[bytes], per_client: int,
                 client: aiohttp.ClientSession) -> tuple[list[tuple[float, float]], float]:
    """Each request's (seconds to the end, seconds to the first token), and the round's wall time."""
    latencies: list[tuple[float, float]] = []

    async def worker(i: int) -> None:
        url, headers = targets[i]
        for j in range(per_client):
            latencies.append(await _one(client, url, bodies[(i * per_client + j) % len(bodies)], headers))

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(len(targets))))
    return latencies, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _metric_sums(text: str, name: str) -> dict[str, float]:
    """``{stage: value}`` of one stage histogram series (``_sum`` or ``_count``) on a /metrics page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'api="openai.chat"' in line:
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = out.get(stage, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _stage_means(before: str, after: str) -> dict[str, float]:
    """Mean milliseconds per call of each proxy stage between two /metrics pages (empty on a proxy
    without the stage histogram)."""
    name = "rollwire_proxy_stage_seconds"
    sums0, sums1 = _metric_sums(before, name + "_sum"), _metric_sums(after, name + "_sum")
    counts0, counts1 = _metric_sums(before, name + "_count"), _metric_sums(after, name + "_count")
    return {stage: (sums1[stage] - sums0.get(stage, 0.0)) * 1000 / (counts1[stage] - counts0.get(stage, 0.0))
            for stage in sums1 if counts1[stage] > counts0.get(stage, 0.0)}


def _numbering(before: str, after: str, name: str) -> str:
    """Between two /metrics pages: the mean milliseconds of numbering a call on the claims log (its claim
    written and read back: ``call_number_mean_ms``) and of the part of it that a call waited for once it had
    been placed and sent to the engine (``call_number_wait_mean_ms``); empty on a proxy without claims."""

    def mean(metric: str) -> float | None:
        def total(text: str, suffix: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(f"{metric}_{suffix} "))

        calls = total(after, "count") - total(before, "count")
        return None if calls <= 0 else (total(after, "sum") - total(before, "sum")) * 1000 / calls

    numbering = mean("rollwire_proxy_call_number_seconds")
    if numbering is None:
        return ""
    waited = mean("rollwire_proxy_call_number_wait_seconds")
    line = f"{name}call_number_mean_ms={numbering:.2f}"
    return line if waited is None else f"{line} {name}call_number_wait_mean_ms={waited:.2f}"


@dataclass
class _Tier:
    """A proxy tier of ``size`` processes behind the real HAProxy front, on topics of its own."""

    size: int
    prefix: str
    ports: list[int]
    processes: list[subprocess.Popen[bytes]]
    front_port: int = 0
    stats_port: int = 0
    front: subprocess.Popen[bytes] | None = None
    workdir: Path | None = None
    metrics_before: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"proxies_{self.size}"

    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}/metrics" for port in self.ports]


def _start_tier(size: int, prefix: str, standin_port: int, bootstrap: str, log_prefix: str,
                started: list[subprocess.Popen[bytes]], tiers: list[_Tier]) -> _Tier:
    """``size`` ``rollwire proxy`` processes and HAProxy in front of them, as ``rollwire up --proxies`` runs
    them (deploy/stack.py's ``proxy_tier``): each process named ``proxy-<i>`` on a port of its own, the front's
    configuration from deploy/proxy_front.py's writer (in a folder of this run's, not the stack's), HAProxy in
    the foreground as ``rollwire proxy-front`` runs it. The tier is appended to ``tiers`` and every process
    to ``started`` at once, so that the caller cleans up after them whatever happens next."""
    tier = _Tier(size, prefix, [_free_port() for _ in range(size)], [])
    tiers.append(tier)
    for i, port in enumerate(tier.ports):
        process = _spawn(["-m", "deploy.cli", "proxy", "--port", str(port),
                          "--engine-url", f"http://127.0.0.1:{standin_port}"],
                         {"ROLLWIRE_KAFKA_BOOTSTRAP": bootstrap, "ROLLWIRE_TOPIC_PREFIX": prefix,
                          "ROLLWIRE_SERVED_MODEL": "rollwire-tiny", "ROLLWIRE_PROXY_INSTANCE": member_name(i)},
                         log_prefix + f"tier{size}-{member_name(i)}.log")
        started.append(process)
        tier.processes.append(process)
    for port, process in zip(tier.ports, tier.processes, strict=True):
        _wait_http(f"http://127.0.0.1:{port}/health", process=process)
    tier.front_port, tier.stats_port = _free_port(), _free_port()
    front = FrontConfig(host="127.0.0.1", port=tier.front_port, stats_port=tier.stats_port,
                        backends=tuple(Backend(member_name(i), "127.0.0.1", port) for i, port in enumerate(tier.ports)),
                        server_timeout_s=server_timeout_s(ProxySettings()))
    tier.workdir = Path(tempfile.mkdtemp(prefix=f"rollwire-bench-front{size}-"))
    config = write_config(front, home=tier.workdir)
    with open(log_prefix + f"tier{size}-front.log", "wb") as out:
        tier.front = subprocess.Popen([haproxy_binary(), "-db", "-f", str(config)], stdout=out,
                                      stderr=subprocess.STDOUT)
    started.append(tier.front)
    _wait_http(f"http://127.0.0.1:{tier.stats_port}{HEALTH_PATH}", process=tier.front)
    _wait_front_up(tier, [member_name(i) for i in range(size)])
    return tier


def _wait_front_up(tier: _Tier, names: list[str], timeout_s: float = 30) -> None:
    """Until the front's stats page shows every process of the tier UP."""
    url = f"http://127.0.0.1:{tier.stats_port}{STATS_PATH};csv"
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            rows = csv.DictReader(io.StringIO(httpx.get(url, timeout=1).text.lstrip("# ")))
            states = {row["svname"]: row["status"] for row in rows if row["pxname"] == BACKEND}
        except httpx.HTTPError:
            pass
        if all(states.get(name) == "UP" for name in names):
            return
        time.sleep(0.25)
    raise RuntimeError(f"the front of {tier.name} did not see every process up: {states}")


def _counter(text: str, prefix: str) -> float:
    """The sum of a metric's series whose lines start with ``prefix`` on a /metrics page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


_SERVED = 'rollwire_proxy_completion_events_total{status="ok"}'
_RESTORES = "rollwire_proxy_restore_seconds_count"


def _sizes(text: str) -> list[int]:
    """``--proxies``: tier sizes, comma-separated, each at least 1."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: tier sizes are 1 or more")
    return sizes


async def run(args: argparse.Namespace) -> None:
    task = asyncio.current_task()
    if task is not None:
        # SIGTERM as Ctrl-C: the run is cancelled and its `finally` stops every process it started.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    bootstrap = os.environ.get("ROLLWIRE_KAFKA_BOOTSTRAP")
    broker = None
    if not bootstrap or not broker_answers(bootstrap):
        config = KafkaConfig.from_env()
        broker = KafkaBroker(config)
        broker.start()
        bootstrap = config.bootstrap
    prefix = f"bench{uuid.uuid4().hex[:6]}."
    kafka = KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=prefix)
    await ensure_topics(kafka)
    floor_kafka = KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=prefix.rstrip(".") + "f.")
    await ensure_topics(floor_kafka)
    # Compressed as the proxy's own events are (ROLLWIRE_CAPTURE_COMPRESSION, `auto` settled on this broker).
    compression = ProxySettings().capture_compression
    if compression == "auto":
        compression = await settle_compression(floor_kafka, 30.0)
    floor = KafkaFloor(floor_kafka, floor_kafka.registry().name(Topic.COMPLETIONS), compress=compression == "producer")

    standin_port, proxy_port = _free_port(), _free_port()
    baseline: subprocess.Popen[bytes] | None = None
    baseline_port = _free_port()
    # Every child in the order started: the `finally` stops them all, the last started first (a tier's front
    # before its processes), on an error or Ctrl-C (SIGTERM too) as at the end.
    started: list[subprocess.Popen[bytes]] = []
    tiers: list[_Tier] = []
    tier_prefixes: list[str] = []
    peers: list[Peer] = []
    floors: dict[str, subprocess.Popen[bytes]] = {}
    quiet_waits: list[float] = []  # before each round, waiting for the machine to be at rest
    try:
        standin = _spawn(["-m", "tests.support.standin_engine", "--port", str(standin_port), "--latency-ms", "20",
                          "--reply-tokens", str(args.reply_tokens), "--token-interval-ms", str(args.token_interval_ms),
                          "--bytes-per-token", "4", *(["--token-api"] if args.token_api else [])], {},
                         args.log_prefix + "standin.log")
        started.append(standin)
        proxy = _spawn(["-m", "deploy.cli", "proxy", "--port", str(proxy_port),
                        "--engine-url", f"http://127.0.0.1:{standin_port}"],
                       {"ROLLWIRE_KAFKA_BOOTSTRAP": bootstrap, "ROLLWIRE_TOPIC_PREFIX": prefix,
                        "ROLLWIRE_SERVED_MODEL": "rollwire-tiny"}, args.log_prefix + "proxy.log")
        started.append(proxy)
        if args.baseline_tree:
            # Another source tree's proxy (e.g. an earlier commit checked out elsewhere), on topics of its own so
            # that the two session registries do not meet; `-m` from that folder imports that tree's code.
            baseline_prefix = prefix.rstrip(".") + "b."
            await ensure_topics(KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=baseline_prefix))
            baseline = _spawn(["-m", "deploy.cli", "proxy", "--port", str(baseline_port),
                               "--engine-url", f"http://127.0.0.1:{standin_port}"],
                              {"ROLLWIRE_KAFKA_BOOTSTRAP": bootstrap, "ROLLWIRE_TOPIC_PREFIX": baseline_prefix,
                               "ROLLWIRE_SERVED_MODEL": "rollwire-tiny"}, args.log_prefix + "baseline.log",
                              cwd=args.baseline_tree)
            started.append(baseline)
        _wait_http(f"http://127.0.0.1:{standin_port}/health", process=standin)
        _wait_http(f"http://127.0.0.1:{proxy_port}/health", process=proxy)
        if baseline is not None:
            _wait_http(f"http://127.0.0.1:{baseline_port}/health", process=baseline)
        # The tiers of more than one process (proxies_1 is `through`): each on topics of its own, so that its
        # sessions (the same ids as through's) and call claims meet no other path's.
        for size in (n for n in args.proxies if n > 1):
            tier_prefix = prefix.rstrip(".") + f"t{size}."
            tier_prefixes.append(tier_prefix)
            await ensure_topics(KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=tier_prefix))
            _start_tier(size, tier_prefix, standin_port, bootstrap, args.log_prefix, started, tiers)
            print(f"# {tiers[-1].name}: http://127.0.0.1:{tiers[-1].front_port} (HAProxy) over "
                  f"{', '.join(f'{member_name(i)} :{port}' for i, port in enumerate(tiers[-1].ports))}", flush=True)
        if args.peers:
            for name, start in (("nginx", lambda: start_nginx(standin_port, args.log_prefix)),
                                ("litellm", lambda: start_litellm(standin_port, "rollwire-tiny", args.log_prefix))):
                try:
                    peers.append(start())
                    print(f"# peer {name}: {peers[-1].version} at {peers[-1].chat_url}", flush=True)
                except PeerMissing as exc:
                    print(f"# peer {name} skipped: {exc}", flush=True)
        direct_url = f"http://127.0.0.1:{standin_port}/v1/chat/completions"
        print(f"# direct: {direct_url}; rollwire: http://127.0.0.1:{proxy_port}", flush=True)
        # The measured streams go through aiohttp's client (a third of httpx's CPU per chunk): the load
        # generator shares this machine's cores with every path it measures, and what it spends is taken
        # from them. Keep-alive below uvicorn's 5 s, so that no request goes out on a connection the
        # server closed. Set-up and /metrics use httpx.
        connector = aiohttp.TCPConnector(limit=args.concurrency * 2, keepalive_timeout=2.0)
        # Encoded once up front: the client's own work should not depend on the path measured.
        bodies = [orjson.dumps(b) for b in harness_requests(args.concurrency)]
        async with httpx.AsyncClient(timeout=300) as client, \
                aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300),
                                      auto_decompress=False) as streams:
            json_type = {"content-type": "application/json"}

            async def session_targets(port: int) -> list[tuple[str, dict[str, str]]]:
                targets = []
                for i in range(args.concurrency):
                    created = await client.post(f"http://127.0.0.1:{port}/v1/sessions",
                                                json={"session_id": f"bench-{i}"})
                    created.raise_for_status()
                    session = created.json()
                    targets.append((f"{session['base_urls']['openai']}/chat/completions",
                                    {**json_type, "authorization": f"Bearer {session['api_key']}"}))
                return targets

            paths: dict[str, list[tuple[str, dict[str, str]]]] = {
                "direct": [(direct_url, json_type)] * args.concurrency,
                "through": await session_targets(proxy_port),
            }
            for tier in tiers:
                # Created through the front (any process may create a session: the others read it from the
                # sessions topic), so the base URL it hands out is the front's, `/s/{session_id}/v1`: the
                # path the front hashes on.
                paths[tier.name] = await session_targets(tier.front_port)
            if baseline is not None:
                paths["baseline"] = await session_targets(baseline_port)
            sessions = paths["direct"]
            for peer in peers:
                paths[peer.name] = [(peer.chat_url, peer.headers) for _ in sessions]
            # Warm every path (connections, caches, producer metadata).
            for targets in paths.values():
                await _round(targets, bodies, 1, streams)
            # The capture stage's floor: the proxy's own events (its warm-up round's), a burst of them at once.
            captured = await read_records(kafka, args.concurrency)
            if args.capture_floor:
                # The same events, written by a bare relay at each stream's end (bench.capture_floor).
                records_file = args.log_prefix + "floor-records.pickle"
                save_records(captured, Path(records_file))
                for mode in ("whole", "early"):
                    port = _free_port()
                    floors[f"floor_{mode}"] = _spawn(
                        ["-m", "bench.capture_floor", "--port", str(port), "--upstream", f"http://127.0.0.1:{standin_port}",
                         "--records", records_file, "--topic", floor_kafka.registry().name(Topic.COMPLETIONS),
                         "--mode", mode, *(["--compress"] if compression == "producer" else [])],
                        {"ROLLWIRE_KAFKA_BOOTSTRAP": bootstrap}, args.log_prefix + f"floor-{mode}.log")
                    started.append(floors[f"floor_{mode}"])
                    _wait_http(f"http://127.0.0.1:{port}/health", process=floors[f"floor_{mode}"])
                    paths[f"floor_{mode}"] = [(f"http://127.0.0.1:{port}/v1/chat/completions", json_type)] * args.concurrency
                    await _round(paths[f"floor_{mode}"], bodies, 1, streams)
            await floor.start()
            await floor.burst(captured)
            floor.ack_s.clear()
            metrics_before = (await client.get(f"http://127.0.0.1:{proxy_port}/metrics")).text
            for tier in tiers:
                tier.metrics_before = [(await client.get(url)).text for url in tier.metrics_urls()]
            results: dict[str, list[float]] = {name: [] for name in paths}
            first_token: dict[str, list[float]] = {name: [] for name in paths}
            elapsed = {name: 0.0 for name in paths}
            # Each path's proxy processes (a tier's: all of them), whose CPU is counted during its rounds, and a
            # tier's front apart.
            cpu_of: dict[str, list[subprocess.Popen[bytes]]] = {
                "through": [proxy], **({"baseline": [baseline]} if baseline is not None else {}),
                **{name: [server] for name, server in floors.items()},
                **{tier.name: tier.processes for tier in tiers}}
            front_of = {tier.name: tier.front for tier in tiers if tier.front is not None}
            proxy_cpu = {name: 0.0 for name in cpu_of}
            front_cpu = {name: 0.0 for name in front_of}
            # The whole machine during each path's rounds: how busy it was, and its CPU per request (the
            # client, the stand-in, the broker and the proxy or peer in between all share these cores).
            meter = CpuMeter({"client": lambda: [os.getpid()], "standin": lambda: [standin.pid],
                              "broker": kafka_broker_pids})
            machine = {name: [0.0, 0.0, 0.0, 0.0, 0.0] for name in paths}  # wall, machine, client, standin, broker
            for _ in range(args.rounds):
                for name, targets in paths.items():
                    quiet_waits.append(await _quiet(meter))
                    processes = cpu_of.get(name, [])
                    cpu = sum(process_cpu_s(process.pid) for process in processes)
                    front = front_of.get(name)
                    cpu_front = process_cpu_s(front.pid) if front is not None else 0.0
                    sample = meter.sample()
                    latencies, seconds = await _round(targets, bodies, args.requests_per_client, streams)
                    use = meter.since(sample)
                    for i, value in enumerate((use.wall_s, use.machine_s, use.named_s["client"],
                                               use.named_s["standin"], use.named_s["broker"])):
                        machine[name][i] += value
                    if processes:
                        proxy_cpu[name] += sum(process_cpu_s(process.pid) for process in processes) - cpu
                    if front is not None:
                        front_cpu[name] += process_cpu_s(front.pid) - cpu_front
                    results[name] += [whole for whole, _ in latencies]
                    first_token[name] += [first for _, first in latencies]
                    elapsed[name] += seconds
                for _ in range(args.requests_per_client):
                    await floor.burst(captured)
            health = (await client.get(f"http://127.0.0.1:{proxy_port}/metrics")).text
            tier_after = {tier.name: [(await client.get(url)).text for url in tier.metrics_urls()] for tier in tiers}
    finally:
        for peer in peers:
            peer.stop()
        for server in reversed(started):
            _stop(server)
        for tier in tiers:
            if tier.workdir is not None:
                shutil.rmtree(tier.workdir, ignore_errors=True)
        await floor.stop()
        # The run's throwaway topics go: a broker that keeps every run's (9 topics a prefix) grows thousands of
        # partition folders, and its acks, the figure this bench measures, slow down with them.
        for topic_prefix in (kafka.topic_prefix, floor_kafka.topic_prefix, *tier_prefixes):
            await delete_topics(bootstrap, topic_prefix)
        if args.baseline_tree:
            await delete_topics(bootstrap, prefix.rstrip(".") + "b.")
        if broker is not None and args.stop_kafka:
            broker.stop()

    recorded = sum(float(line.rsplit(" ", 1)[1]) for line in health.splitlines()
                   if line.startswith('rollwire_proxy_completion_events_total{status="ok"}'))
    d, t = results["direct"], results["through"]
    direct_rps = len(d) / elapsed["direct"]
    print(f"concurrency={args.concurrency}")
    print(f"requests_per_path={len(d)}")
    print(f"quiet_wait_mean_ms={statistics.mean(quiet_waits) * 1000:.0f} quiet_wait_max_ms={max(quiet_waits) * 1000:.0f}")
    print(f"request_kb_mean={statistics.mean(len(b) for b in bodies) / 1024:.1f}")
    print(f"direct_p50_ms={_pct(d, 0.5):.2f}")
    print(f"direct_p99_ms={_pct(d, 0.99):.2f}")
    print(f"direct_rps={direct_rps:.1f}")
    others = [peer.name for peer in peers] + (["baseline"] if baseline is not None else []) + list(floors)
    for name in others:
        p = results[name]
        print(f"{name}_p50_ms={_pct(p, 0.5):.2f}")
        print(f"{name}_p99_ms={_pct(p, 0.99):.2f}")
        print(f"{name}_added_p50_ms={_pct(p, 0.5) - _pct(d, 0.5):.2f}")
        print(f"{name}_added_p99_ms={_pct(p, 0.99) - _pct(d, 0.99):.2f}")
        print(f"{name}_throughput_ratio={(len(p) / elapsed[name]) / direct_rps:.3f}")
        print(f"{name}_added_first_token_p50_ms={_pct(first_token[name], 0.5) - _pct(first_token['direct'], 0.5):.2f}")
        if name in proxy_cpu:
            print(f"{name}_proxy_cpu_ms_per_request={proxy_cpu[name] * 1000 / len(p):.2f}")
    print(f"through_p50_ms={_pct(t, 0.5):.2f}")
    print(f"through_p99_ms={_pct(t, 0.99):.2f}")
    print(f"through_rps={len(t) / elapsed['through']:.1f}")
    # Where the added time falls: before the first token (reading and parsing the request, the upstream
    # call) or after it (the relay and the ack at the end).
    added_first = _pct(first_token["through"], 0.5) - _pct(first_token["direct"], 0.5)
    print(f"direct_first_token_p50_ms={_pct(first_token['direct'], 0.5):.2f} "
          f"through_first_token_p50_ms={_pct(first_token['through'], 0.5):.2f} added_first_token_p50_ms={added_first:.2f}")
    print(f"events_recorded={int(recorded)}")
    # The proxy's own CPU per call (its rounds only): steadier than latencies on a busy machine.
    print(f"through_proxy_cpu_ms_per_request={proxy_cpu['through'] * 1000 / len(t):.2f}")
    cores = os.cpu_count() or 1
    for name, (wall, busy, client_s, standin_s, broker_s) in machine.items():
        n = len(results[name])
        print(f"{name}_machine_busy={busy / (wall * cores) if wall > 0 else 0.0:.2f} "
              f"{name}_machine_cpu_ms_per_request={busy * 1000 / n:.2f} "
              f"{name}_client_cpu_ms_per_request={client_s * 1000 / n:.2f} "
              f"{name}_standin_cpu_ms_per_request={standin_s * 1000 / n:.2f} "
              f"{name}_broker_cpu_ms_per_request={broker_s * 1000 / n:.2f}")
    added_p50 = _pct(t, 0.5) - _pct(d, 0.5)
    stages = _stage_means(metrics_before, health)
    for stage in ("parse", "upstream_wait", "relay", "capture"):
        if stage in stages:
            print(f"stage_{stage}_mean_ms={stages[stage]:.2f}")
    if numbering := _numbering(metrics_before, health, ""):
        print(numbering)  # the call claim's time, and the part of it a call waited for (in `upstream_wait`)
    if "capture" in stages:
        # The ack (Kafka capture) is the one stage that lies wholly inside the added time.
        print(f"ack_share_of_added_p50={stages['capture'] / added_p50 if added_p50 > 0 else float('nan'):.2f}")
    if floor.ack_s:
        # A bare producer's ack for the same records, `concurrency` at once: what capture costs at best here.
        print(f"kafka_floor_compressed_by={'producer' if floor.compress else 'broker'}")
        print(f"kafka_floor_records={len(floor.ack_s)} kafka_floor_record_kb_mean="
              f"{statistics.mean(len(r.value) for r in captured) / 1024:.1f}")
        print(f"kafka_floor_ack_mean_ms={statistics.mean(floor.ack_s) * 1000:.2f} "
              f"kafka_floor_ack_p50_ms={_pct(floor.ack_s, 0.5):.2f} kafka_floor_ack_p99_ms={_pct(floor.ack_s, 0.99):.2f}")
        if "capture" in stages:
            print(f"capture_over_kafka_floor={stages['capture'] / (statistics.mean(floor.ack_s) * 1000):.2f}")
    for name in others:
        other_added = _pct(results[name], 0.5) - _pct(d, 0.5)
        print(f"rollwire_over_{name}_added_p50={added_p50 / other_added if other_added > 0 else float('nan'):.3f}")
    print(f"added_p99_ms={_pct(t, 0.99) - _pct(d, 0.99):.2f}")
    print(f"throughput_ratio={(len(t) / elapsed['through']) / direct_rps:.3f}")
    print(f"added_p50_ms={added_p50:.2f}")
    if args.proxies:
        _print_tiers(args.proxies, tiers, results, first_token, elapsed, proxy_cpu, front_cpu, tier_after)


def _print_tiers(sizes: list[int], tiers: list[_Tier], results: dict[str, list[float]],
                 first_token: dict[str, list[float]], elapsed: dict[str, float], proxy_cpu: dict[str, float],
                 front_cpu: dict[str, float], after: dict[str, list[str]]) -> None:
    """Each tier's figures, then per size its added p50 and p99 and its added p50 over ``floor_whole``'s; the
    largest size's ratio last (its added p50 without ``--capture-floor``)."""
    d = results["direct"]
    direct_rps = len(d) / elapsed["direct"]
    print("# proxies_1 is the single proxy measured directly (path `through`: no front); proxies_N for N > 1 are "
          "N processes behind HAProxy")
    for tier in tiers:
        name, p = tier.name, results[tier.name]
        print(f"{name}_p50_ms={_pct(p, 0.5):.2f}")
        print(f"{name}_p99_ms={_pct(p, 0.99):.2f}")
        print(f"{name}_throughput_ratio={(len(p) / elapsed[name]) / direct_rps:.3f}")
        print(f"{name}_added_first_token_p50_ms={_pct(first_token[name], 0.5) - _pct(first_token['direct'], 0.5):.2f}")
        # The processes' CPU together, and HAProxy's apart: what the tier costs the machine per call.
        print(f"{name}_proxy_cpu_ms_per_request={proxy_cpu[name] * 1000 / len(p):.2f} "
              f"{name}_front_cpu_ms_per_request={front_cpu.get(name, 0.0) * 1000 / len(p):.2f}")
        # How the front spread the calls (each session kept on one process), and whether any call found its
        # session's branches behind the log (a restore: only when a session's calls moved between processes).
        served = [_counter(a, _SERVED) - _counter(b, _SERVED) for b, a in zip(tier.metrics_before, after[name],
                                                                              strict=True)]
        restores = sum(_counter(a, _RESTORES) - _counter(b, _RESTORES)
                       for b, a in zip(tier.metrics_before, after[name], strict=True))
        print(f"{name}_calls_per_process={'/'.join(str(int(n)) for n in served)} {name}_restores={int(restores)}")
        # The stage means over all the tier's calls (what a call waited for its number falls in `upstream_wait`).
        stages = _stage_means("\n".join(tier.metrics_before), "\n".join(after[name]))
        print(" ".join(f"{name}_stage_{stage}_mean_ms={stages[stage]:.2f}"
                       for stage in ("parse", "upstream_wait", "relay", "capture") if stage in stages))
        if numbering := _numbering("\n".join(tier.metrics_before), "\n".join(after[name]), f"{name}_"):
            print(numbering)
    floor = results.get("floor_whole")
    floor_added = _pct(floor, 0.5) - _pct(d, 0.5) if floor else float("nan")
    for size in sizes:
        p = results["through" if size == 1 else f"proxies_{size}"]
        added = _pct(p, 0.5) - _pct(d, 0.5)
        if floor:
            print(f"proxies_{size}_added_p50_ms={added:.2f}")
            print(f"proxies_{size}_added_p99_ms={_pct(p, 0.99) - _pct(d, 0.99):.2f}")
            print(f"proxies_{size}_over_floor={added / floor_added if floor_added > 0 else float('nan'):.3f}")
        else:
            print(f"# proxies_{size}_over_floor: no floor_whole to divide by (--capture-floor)")
            print(f"proxies_{size}_added_p99_ms={_pct(p, 0.99) - _pct(d, 0.99):.2f}")
            print(f"proxies_{size}_added_p50_ms={added:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--reply-tokens", type=int, default=64, help="Tokens per streamed reply.")
    parser.add_argument("--token-interval-ms", type=float, default=8.0,
                        help="Pace of the stand-in's stream after its 20 ms first-token latency.")
    parser.add_argument("--token-api", action="store_true", help=(
        "The stand-in serves vLLM's token endpoints, so the proxy takes its exact-continuation path (render, "
        "generate, derender; the stream synthesized once the turn is parsed) instead of relaying chat streams."))
    parser.add_argument("--log-prefix", default="/tmp/rollwire-bench-", help="Where the servers' logs go.")
    parser.add_argument("--peers", action="store_true", help=(
        "Also measure a bare nginx reverse proxy and LiteLLM's proxy in front of the same stand-in "
        "(bench/peers.py); a peer that is not installed is skipped with the reason."))
    parser.add_argument("--baseline-tree", help=(
        "Also measure the proxy of another source tree (e.g. `git worktree add /tmp/base HEAD~3`) as path "
        "`baseline`, beside this one in the same run."))
    parser.add_argument("--capture-floor", action="store_true", help=(
        "Also measure bare relays that hold each stream's end for Kafka's ack of rollwire's own event "
        "(bench/capture_floor.py): `floor_whole` writes it at the end, `floor_early` its prompt part at the first "
        "read and the rest at the end."))
    parser.add_argument("--proxies", type=_sizes, default=[], metavar="N,N", help=(
        "Also measure a proxy tier of each size: `proxies_N`, N proxy processes behind the real HAProxy front "
        "(deploy/proxy_front.py), sessions spread by its hash on their paths; `proxies_1` is the single proxy "
        "measured directly (`through`), as with N = 1 no front runs. E.g. `--proxies 1,2`."))
    parser.add_argument("--stop-kafka", action="store_true", help="Stop the broker if this run started it.")
    try:
        asyncio.run(run(parser.parse_args()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        # Ctrl-C or SIGTERM: the run's `finally` has stopped its processes and deleted its topics.
        sys.exit("interrupted")


if __name__ == "__main__":
    main()
