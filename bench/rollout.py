"""Gateway node throughput: sessions per minute for N concurrent sessions, pre-warm off and on, side by side.

A fixed short harness (the ``command`` adapter running a Python script that makes ``--calls`` chat
completion calls through the proxy, ``--think`` seconds after each) in the ``local`` runtime, whose init
has a realistic set-up cost (``--setup-s``: a set-up command that sleeps, on top of the workspace's git
init). Each phase runs a gateway node in this process on a fresh topic prefix of the broker at
``ROLLWIRE_KAFKA_BOOTSTRAP`` (default: the project's local one), with a proxy over the stand-in engine;
all N sessions are published at once and the clock runs from the publish to the last ``session.ended``.
Phase ``off``: ``prewarm=0`` (a runtime is initialized only when a run slot is free: init on the critical
path); phase ``on``: ``prewarm=N`` (runtimes initialized ahead, up to ``--init-workers`` at once).

    python -m bench.rollout [--sessions N] [--run-slots R] [--init-workers W] [--setup-s S] [--calls C]

Prints ``name=value`` lines, the key figure last: ``prewarm_speedup`` (sessions/min on ÷ off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.serving import serve
from bench.standin_engine import StandinConfig, create_app as create_standin
from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings
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
            node = GatewayNode(settings, kafka, runtime_for=lambda kind: LocalRuntime(root=root))
            node_task = asyncio.create_task(node.run())
            await asyncio.wait_for(node.started.wait(), 60)
            command = f"{sys.executable} {script} {args.calls} {args.think}"
            specs = [SessionSpec(session_id=f"bench-{uuid.uuid4().hex[:12]}", task_id="bench",
                                 instruction="answer", timeout_s=600, api_key=f"key-{uuid.uuid4().hex}",
                                 runtime=RuntimeSpec(setup=[f"sleep {args.setup_s}"]),
                                 agent=AgentSpec(harness="command", command=command))
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
    return out


async def bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        script = Path(tmp) / "harness.py"
        script.write_text(HARNESS)
        off = await _phase(args, 0, script, Path(tmp) / "off")
        on = await _phase(args, args.sessions, script, Path(tmp) / "on")
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
