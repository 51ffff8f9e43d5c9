"""Gateway node throughput: sessions per minute for N concurrent sessions, pre-warm off and on, side by side.

A fixed short harness (the ``command`` adapter running a Python script that makes ``--calls`` chat
completion calls through the proxy, ``--think`` seconds after each) in the ``local`` runtime, whose init
has a realistic set-up cost (``--setup-s``: a set-up command that sleeps, on top of the workspace's git
init). Each phase runs a gateway node in this process on a fresh topic prefix of the broker at
``ROLLWIRE_KAFKA_BOOTSTRAP`` (default: the project's local one), with a proxy over the stand-in engine;
all N sessions are published at once and the clock runs from the publish to the last ``session.ended``.
Phase ``off``: ``prewarm=0`` (a runtime is initialized only when a run slot is free: init on the critical
path); phase ``on``: ``prewarm=N`` (runtimes initialized ahead, up to ``--init-workers`` at once).

``--runtime docker`` runs each session in its own container of ``--image`` (default: the first SWE-style
example's image, ``rollwire images build`` makes it; its repository at ``/testbed`` is the workspace), the
harness script mounted read-only, the proxy reached through the socket relay (the container has no
network); it also prints the containers' start times (create to ready, ``container_start_p50_s``).

    python -m bench.rollout [--runtime local|docker] [--sessions N] [--run-slots R] [--init-workers W]
                            [--setup-s S] [--calls C]

Prints ``name=value`` lines, the key figure last: ``prewarm_speedup`` (sessions/min on ÷ off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.serving import serve
from tests.support.standin_engine import StandinConfig, create_app as create_standin
from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings
from producers.runtimes.base import Runtime, RuntimeHandle
from producers.runtimes.local import LocalRuntime
from proxy.app import create_app as create_proxy
from proxy.settings import ProxySettings
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.tasks import AgentSpec, RuntimeSpec
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings, delete_topics, ensure_topics

HARNESS = r'''
import json, os, sys, time, urllib.request
calls, think = int(sys.argv[1]), float(sys.argv[2])
for i in range(calls):
    body = {"model": os.environ["ROLLWIRE_MODEL"], "max_tokens": 8,
            "messages": [{"role": "user", "content": f"step {i}: " + os.environ["ROLLWIRE_INSTRUCTION"]}]}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = json.load(response)["choices"][0]["message"]["content"]
    with open("answer.txt", "a") as out:
        out.write(f"{i}: {text!r}\n")
    time.sleep(think)
'''


DEFAULT_DOCKER_IMAGE = "rollwire/swe-rollwire__textstats-1:latest"


class TimedRuntime(Runtime):
    """A runtime that remembers each container's start time (``handle.start_s``, docker only)."""

    def __init__(self, inner: Runtime) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.start_s: list[float] = []

    async def init(self, session_id: str, spec: RuntimeSpec, *, timeout_s: float) -> RuntimeHandle:
        handle = await self.inner.init(session_id, spec, timeout_s=timeout_s)
        start_s = getattr(handle, "start_s", None)
        if start_s is not None:
            self.start_s.append(float(start_s))
        return handle

    def proxy_url_for(self, proxy_url: str) -> str:
        return self.inner.proxy_url_for(proxy_url)


def _runtime(args: argparse.Namespace, root: Path) -> TimedRuntime:
    if args.runtime == "docker":
        from producers.runtimes.docker import DockerRuntime
        return TimedRuntime(DockerRuntime(root=root))
    return TimedRuntime(LocalRuntime(root=root))


def _spec(args: argparse.Namespace, script: Path) -> tuple[RuntimeSpec, str]:
    """The sessions' runtime and harness command line."""
    setup = [f"sleep {args.setup_s}"]
    if args.runtime == "docker":
        runtime = RuntimeSpec(kind="docker", image=args.image, workdir="/testbed", setup=setup,
                              mounts=[f"{script.parent}:/bench:ro"])
        return runtime, f"python3 /bench/{script.name} {args.calls} {args.think}"
    return RuntimeSpec(setup=setup), f"{sys.executable} {script} {args.calls} {args.think}"


async def _phase(args: argparse.Namespace, prewarm: int, script: Path, root: Path) -> dict[str, float]:
    """One node, N sessions at once; returns sessions/min and mean seconds per stage."""
    base = KafkaSettings()
    kafka = base.model_copy(update={"topic_prefix": f"bench-rollout-{uuid.uuid4().hex[:8]}."})
    await ensure_topics(kafka)
    try:
        with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16))) as engine_url, \
                serve(create_proxy(ProxySettings(engine_url=engine_url, session_wait_s=1.0), kafka)) as proxy_url:
            settings = GatewaySettings(proxy_url=proxy_url, port=0, run_slots=args.run_slots, prewarm=prewarm,
                                       init_workers=args.init_workers, post_workers=args.run_slots,
                                       node_name=f"bench-{prewarm}")
            runtime = _runtime(args, root)
            node = GatewayNode(settings, kafka, runtime_for=lambda kind: runtime)
            node_task = asyncio.create_task(node.run())
            await asyncio.wait_for(node.started.wait(), 60)
            runtime_spec, command = _spec(args, script)
            specs = [SessionSpec(session_id=f"bench-{uuid.uuid4().hex[:12]}", task_id="bench",
                                 instruction="answer", timeout_s=600, api_key=f"key-{uuid.uuid4().hex}",
                                 runtime=runtime_spec, agent=AgentSpec(harness="command", command=command))
                     for _ in range(args.sessions)]
            ends: dict[str, SessionEnded] = {}
            async with EventConsumer(kafka, [Topic.SESSION_EVENTS], group_id=None, dead_letters=False,
                                     from_beginning=True) as consumer:
                async with EventProducer(kafka, service="bench") as producer:
                    # Wait until the node holds its partitions, so the clock measures sessions, not the join.
                    while node.partitions() == 0:
                        await asyncio.sleep(0.1)
                    started = time.monotonic()
                    await producer.send_many(specs)
                while len(ends) < len(specs):
                    for received in await consumer.getmany(timeout_ms=200):
                        if isinstance(received.event, SessionEnded):
                            ends[received.event.session_id] = received.event
                elapsed = time.monotonic() - started
            node.drain()
            await asyncio.wait_for(node_task, 120)
    finally:
        await delete_topics(kafka.kafka_bootstrap, kafka.topic_prefix)
    failed = [e for e in ends.values() if e.status is not SessionStatus.COMPLETED]
    if failed:
        raise SystemExit(f"{len(failed)} sessions did not complete: {failed[0].reason}")
    out = {"sessions_per_min": len(specs) / elapsed * 60, "elapsed_s": elapsed}
    for stage in ("queued", "init", "ready", "running"):
        out[f"mean_{stage}_s"] = sum(e.timings.get(stage, 0.0) for e in ends.values()) / len(ends)
    if runtime.start_s:
        out["container_start_p50_s"] = statistics.median(runtime.start_s)
        out["container_start_max_s"] = max(runtime.start_s)
    return out


async def bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        script = Path(tmp) / "harness.py"
        script.write_text(HARNESS)
        off = await _phase(args, 0, script, Path(tmp) / "off")
        on = await _phase(args, args.sessions, script, Path(tmp) / "on")
    print(f"runtime={args.runtime}")
    print(f"sessions={args.sessions}")
    print(f"run_slots={args.run_slots}")
    print(f"init_workers={args.init_workers}")
    print(f"setup_s={args.setup_s}")
    print(f"harness_calls={args.calls}")
    for name, phase in (("prewarm_off", off), ("prewarm_on", on)):
        for key, value in phase.items():
            print(f"{name}_{key}={value:.3f}")
    print(f"prewarm_speedup={on['sessions_per_min'] / off['sessions_per_min']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", choices=("local", "docker"), default="local")
    parser.add_argument("--image", default=DEFAULT_DOCKER_IMAGE,
                        help="The docker runtime's image: a git repository at /testbed and python3.")
    parser.add_argument("--sessions", type=int, default=16, help="Sessions per phase, published at once.")
    parser.add_argument("--run-slots", type=int, default=4)
    parser.add_argument("--init-workers", type=int, default=8)
    parser.add_argument("--setup-s", type=float, default=1.0, help="Seconds the runtime's set-up command sleeps.")
    parser.add_argument("--calls", type=int, default=2, help="Chat completion calls per harness run.")
    parser.add_argument("--think", type=float, default=0.3, help="Seconds the harness waits after each call.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # transient NotLeader noise on fresh topics
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
