"""What capture costs a harness: the stand-in engine called directly and through the proxy, side by side.

One run starts the project's Kafka (or uses ``ROLLWIRE_KAFKA_BOOTSTRAP``), the stand-in engine (fixed
20 ms latency, recorded vLLM stream shapes, about 4 bytes per token), and the proxy with durable capture
(every reply's end waits for Kafka's ack). 64 concurrent clients stream realistic 30–50 KB harness
requests, alternating rounds direct and through the proxy so that both see the same machine noise.

Prints: direct and through latency percentiles (time to the end of the stream), the added latency at
p50 and p99, throughputs and their ratio, and events recorded. Key figure last.

    python -m bench.proxy_overhead [--concurrency 64] [--rounds 4] [--requests-per-client 4] [--token-api]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid

import httpx
import orjson

from bench.harness_requests import harness_requests
from deploy.kafka import KafkaBroker, KafkaConfig
from schemas.transport import KafkaSettings, broker_answers, ensure_topics


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(args: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *args], env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT)


def _wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def _one(client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]) -> float:
    start = time.perf_counter()
    try:
        return await _timed_stream(client, url, body, headers, start)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"{url}: {exc!r}") from exc


async def _timed_stream(client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str],
                        start: float) -> float:
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code} {(await response.aread())[:300]!r}")
        done = False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
        if not done:
            raise RuntimeError(f"{url}: stream ended without [DONE]")
    return time.perf_counter() - start


async def _round(targets: list[tuple[str, dict[str, str]]], bodies: list[bytes], per_client: int,
                 client: httpx.AsyncClient) -> tuple[list[float], float]:
    latencies: list[float] = []

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


async def run(args: argparse.Namespace) -> None:
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

    standin_port, proxy_port = _free_port(), _free_port()
    standin = _spawn(["-m", "bench.standin_engine", "--port", str(standin_port), "--latency-ms", "20",
                      "--reply-tokens", str(args.reply_tokens), "--token-interval-ms", str(args.token_interval_ms),
                      "--bytes-per-token", "4", *(["--token-api"] if args.token_api else [])], {},
                     args.log_prefix + "standin.log")
    proxy = _spawn(["-m", "deploy.cli", "proxy", "--port", str(proxy_port),
                    "--engine-url", f"http://127.0.0.1:{standin_port}"],
                   {"ROLLWIRE_KAFKA_BOOTSTRAP": bootstrap, "ROLLWIRE_TOPIC_PREFIX": prefix,
                    "ROLLWIRE_SERVED_MODEL": "rollwire-tiny"}, args.log_prefix + "proxy.log")
    try:
        _wait_http(f"http://127.0.0.1:{standin_port}/health")
        _wait_http(f"http://127.0.0.1:{proxy_port}/health")
        direct_url = f"http://127.0.0.1:{standin_port}/v1/chat/completions"
        # Below uvicorn's 5 s keep-alive, so that no request goes out on a connection the server closed.
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2,
                              keepalive_expiry=2.0)
        # Encoded once up front: the client's own work should not depend on the path measured.
        bodies = [orjson.dumps(b) for b in harness_requests(args.concurrency)]
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            sessions = []
            for i in range(args.concurrency):
                created = await client.post(f"http://127.0.0.1:{proxy_port}/v1/sessions",
                                            json={"session_id": f"bench-{i}"})
                created.raise_for_status()
                sessions.append(created.json())
            json_type = {"content-type": "application/json"}
            through = [(f"{s['base_urls']['openai']}/chat/completions",
                        {**json_type, "authorization": f"Bearer {s['api_key']}"}) for s in sessions]
            direct = [(direct_url, json_type) for _ in sessions]
            # Warm both paths (connections, JIT-free but caches and producer metadata).
            await _round(direct, bodies, 1, client)
            await _round(through, bodies, 1, client)
            results: dict[str, list[float]] = {"direct": [], "through": []}
            elapsed = {"direct": 0.0, "through": 0.0}
            for _ in range(args.rounds):
                for name, targets in (("direct", direct), ("through", through)):
                    latencies, seconds = await _round(targets, bodies, args.requests_per_client, client)
                    results[name] += latencies
                    elapsed[name] += seconds
            health = (await client.get(f"http://127.0.0.1:{proxy_port}/metrics")).text
    finally:
        proxy.terminate()
        standin.terminate()
        proxy.wait(10)
        standin.wait(10)
        if broker is not None and args.stop_kafka:
            broker.stop()

    recorded = sum(float(line.rsplit(" ", 1)[1]) for line in health.splitlines()
                   if line.startswith('rollwire_proxy_completion_events_total{status="ok"}'))
    d, t = results["direct"], results["through"]
    print(f"requests_per_path={len(d)}")
    print(f"request_kb_mean={statistics.mean(len(b) for b in bodies) / 1024:.1f}")
    print(f"direct_p50_ms={_pct(d, 0.5):.2f}")
    print(f"direct_p99_ms={_pct(d, 0.99):.2f}")
    print(f"through_p50_ms={_pct(t, 0.5):.2f}")
    print(f"through_p99_ms={_pct(t, 0.99):.2f}")
    print(f"direct_rps={len(d) / elapsed['direct']:.1f}")
    print(f"through_rps={len(t) / elapsed['through']:.1f}")
    print(f"events_recorded={int(recorded)}")
    print(f"added_p99_ms={_pct(t, 0.99) - _pct(d, 0.99):.2f}")
    print(f"throughput_ratio={(len(t) / elapsed['through']) / (len(d) / elapsed['direct']):.3f}")
    print(f"added_p50_ms={_pct(t, 0.5) - _pct(d, 0.5):.2f}")


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
    parser.add_argument("--stop-kafka", action="store_true", help="Stop the broker if this run started it.")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
