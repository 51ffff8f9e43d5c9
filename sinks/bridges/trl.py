"""TRL's GRPO loss on rollwire's rows: a ``GRPOTrainer`` subclass fed by the trainer feed (online) or an
RL rows file (offline), which pushes its weights through the proxy after every step.

    from sinks.bridges.trl import FeedRows, TrlBridgeConfig, grpo_config, rollwire_grpo_trainer
    trainer = rollwire_grpo_trainer(model, tokenizer, FeedRows(feed), grpo_config("out", max_steps=20),
                                    TrlBridgeConfig(proxy_url="http://127.0.0.1:8000", out=Path("ckpt")))
    trainer.train()

Why a subclass and not TRL's public ``rollout_func``: ``rollout_func`` returns one completion per prompt
copy and TRL then computes its own group advantage from ``reward_funcs``; a rollwire session can hold
several branches (one row each, all carrying the session's advantage) and the advantages are rollwire's
(the groups worker's, with failed sessions kept out of the baselines and the feed's staleness weights).
The subclass overrides ``_generate_and_score_completions`` (private, hence TRL pinned to 1.16.0), which
hands ``_compute_loss`` its inputs; TRL's loss accepts ``(B, T)`` advantages. TRL's async trainer's
rollout-worker protocol carries branches too, but it needs CUDA (its FlashAttention kernels and NCCL):
``trl_async.py`` has those adapters for GPU users; this trainer is the one that runs everywhere.

What one step does (:meth:`RollwireGRPOTrainer._generate_and_score_completions`, then the optimizer, then
:meth:`RollwireGRPOTrainer.after_step`):

1. **Rows** from the source (a feed batch of whole groups, or a file's next groups), passed through
   :func:`sinks.bridges.rows.usable_rows` (bad input dropped or cut, each case counted).
2. **Split** every row at the batch's earliest trained token: the columns before it are TRL's prompt, the
   rest its completion, right-padded as the feed lays rows out (positions stay 0..n-1, as the engine ran
   them). TRL's ``tool_mask`` is rollwire's loss mask over the completion columns: 0 on tool outputs,
   template glue, the part of a longer prompt that lies in the completion columns, and padding.
3. **Importance sampling** against the rollout logprobs: one no-grad forward gives ``old`` (the current
   weights' logprobs at ``logits / temperature``); ``w = min(exp(old - rollout), is_cap)`` per trained
   token, truncated importance sampling, folded into the per-token advantages (``A * w``; exact for TRL's
   clipped loss since ``w >= 0``). ``old`` is passed as ``old_per_token_logps``, so TRL's PPO ratio is
   against the weights before this update. ``temperature`` must be the sessions' sampling temperature,
   with an engine that returns processed logprobs (the embedded engine does).
4. **Loss and step**: TRL's ``_compute_loss`` and optimizer, untouched.
5. **Save and push**: the weights as a Hugging Face folder (sinks/trainer/checkpoints.py: ``lm_head``
   stored even when tied), ``POST /v1/policy/weights`` as the next version (sinks/trainer/policy.py),
   then the source is told the version (the feed measures staleness against it) and acknowledged.

The run ends when ``max_steps`` steps are done or the source has nothing more (a feed idle for its
``idle_timeout_s``, the end of a file). TRL settings that would change the data flow are refused in the
constructor: ``use_vllm`` (the engines are rollwire's), ``num_iterations`` and ``steps_per_generation``
other than 1 (one source batch is one optimizer step, pushed before the next), ``beta`` other than 0.

Torch and TRL come from the environment (``pip install 'rollwire[trl]'``); torch may also be borrowed
from rollwire's vLLM environment (sinks/trainer/torch_env.py), before transformers is imported.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sinks.bridges.rows import GroupedRows, Row, RowCounts, read_rl_rows, rows_of_batch, usable_rows
from sinks.errors import TrainerError
from sinks.trainer.checkpoints import prune_checkpoints, save_checkpoint
from sinks.trainer.policy import PolicyClient
from sinks.trainer.torch_env import import_torch

TRL_VERSION = "1.16.0"


class RowSource(Protocol):
    """Where a step's rows come from, and whom to tell once they are trained on."""

    def next_rows(self) -> list[Row] | None:
        """The next step's rows (whole groups), or None when there are no more."""

    def done(self, version: int | None) -> None:
        """The rows last returned are trained on (or passed over); ``version``: the policy now serving."""


@dataclass
class FeedRows:
    """A :class:`sinks.feed.TrainerFeed` (padded batches) as a row source: ``done`` sets the feed's policy
    version and acknowledges the batch, so a crashed trainer resumes after its last step."""

    feed: Any
    missing_logprobs: int = 0
    """Sampled tokens the feed left out of the loss mask for want of a logprob (``Batch.missing_logprobs``):
    a row without any logprob reaches the bridge with no trained token."""
    _last: Any = None
    _batches: Iterator[Any] | None = None

    def next_rows(self) -> list[Row] | None:
        if self._batches is None:
            self._batches = iter(self.feed)
        batch = next(self._batches, None)
        self._last = batch
        if batch is None:
            return None
        self.missing_logprobs += int(batch.missing_logprobs)
        return rows_of_batch(batch)

    def done(self, version: int | None) -> None:
        if version is not None:
            self.feed.policy_version = version
        if self._last is not None:
            self.feed.ack(self._last)


@dataclass
class FileRows:
    """An RL rows file (sinks/bridges/rows.py) as a row source, ``groups_per_step`` groups a step."""

    path: Path
    groups_per_step: int = 1
    _steps: GroupedRows | None = None

    def next_rows(self) -> list[Row] | None:
        if self._steps is None:
            self._steps = GroupedRows(read_rl_rows(self.path), self.groups_per_step)
        return self._steps.next_step()

    def done(self, version: int | None) -> None:
        return None


@dataclass(frozen=True)
class TrlBridgeConfig:
    """What the bridge adds to TRL's ``GRPOConfig``: the bad-input rules, the importance weights' cap, and
    where the weights go after each step (no ``proxy_url``: saved only, for offline training)."""

    max_length: int | None = None
    """Rows longer than this are cut to their first ``max_length`` tokens (None: never)."""
    min_group_sessions: int = 2
    is_cap: float = 2.0
    proxy_url: str | None = None
    out: Path | None = None
    """Where checkpoints go (``policy-v<version>``); required with ``proxy_url``."""
    start_version: int = 0
    keep_checkpoints: int = 2
    drain_timeout_s: float = 600.0
    max_empty_batches: int = 1000
    """Source batches in a row with nothing usable before the run ends (each is acknowledged)."""


@dataclass
class BridgeStep:
    """One step as the bridge saw it."""

    step: int
    rows: int
    groups: int
    trained_tokens: int
    masked_tokens: int
    is_ratio_mean: float
    is_ratio_min: float
    is_ratio_max: float
    is_truncated: float
    reward_mean: float | None
    loss: float = math.nan
    policy_version: int | None = None
    checkpoint: Path | None = None
    sync_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        reward = "nan" if self.reward_mean is None else f"{self.reward_mean:.3f}"
        return (f"step={self.step} policy_version={self.policy_version} rows={self.rows} groups={self.groups} "
                f"reward_mean={reward} loss={self.loss:.6f} is_ratio={self.is_ratio_mean:.4f} "
                f"is_ratio_min={self.is_ratio_min:.4f} is_ratio_max={self.is_ratio_max:.4f} "
                f"trained_tokens={self.trained_tokens} masked_tokens={self.masked_tokens} sync_s={self.sync_s:.2f}")


class SourceDone(Exception):
    """The row source has nothing more: the run ends after the steps taken."""


def grpo_config(output_dir: str | Path, **overrides: Any) -> Any:
    """A ``trl.GRPOConfig`` with the settings the bridge needs (one source batch per optimizer step, no
    vLLM, no reference model, float32 on CPU, nothing reported or saved by TRL itself); ``overrides``
    are TRL's own settings (``learning_rate``, ``temperature``, ``max_steps``, ``loss_type``, ...)."""
    torch = import_torch()
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(output_dir), "per_device_train_batch_size": 2, "num_generations": 2,
        "gradient_accumulation_steps": 1, "steps_per_generation": 1, "num_iterations": 1, "beta": 0.0,
        "use_vllm": False, "bf16": False, "fp16": False, "use_cpu": not torch.cuda.is_available(),
        "report_to": "none", "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True,
        "gradient_checkpointing": False, "max_grad_norm": 1.0, "lr_scheduler_type": "constant",
        "warmup_steps": 0, "weight_decay": 0.0, "log_completions": False,
    }
    settings.update(overrides)
    return GRPOConfig(**settings)


def _no_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """TRL requires a reward function; rollwire's rewards and advantages come with the rows."""
    return [0.0] * len(prompts)


@functools.cache
def grpo_trainer_class() -> type:
    """``RollwireGRPOTrainer``, built on first use (TRL is imported here, not with this module)."""
    torch = import_torch()
    import importlib

    transformers = importlib.import_module("transformers")
    if not transformers.utils.is_torch_available():
        raise TrainerError("transformers was imported before torch could be found (it decides once): call "
                           "sinks.trainer.import_torch() before importing transformers")
    import trl
    Dataset = importlib.import_module("datasets").Dataset
    from transformers import TrainerCallback

    if trl.__version__ != TRL_VERSION:
        raise TrainerError(f"the TRL bridge overrides TRL {TRL_VERSION}'s private methods; found TRL "
                           f"{trl.__version__}: pip install 'rollwire[trl]'")

    class AfterStep(TrainerCallback):
        """Saves and pushes the weights once the optimizer has stepped (TrainerCallback.on_step_end)."""

        def __init__(self, owner: Any) -> None:
            self.owner = owner

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self.owner.after_step()
            return control

    class RollwireGRPOTrainer(trl.GRPOTrainer):
        """TRL's GRPO trainer on rollwire's rows; see the module docstring."""

        def __init__(self, model: Any, processing_class: Any, source: RowSource, args: Any,
                     bridge: TrlBridgeConfig | None = None, policy: PolicyClient | None = None,
                     on_step: Any = None) -> None:
            bridge = bridge or TrlBridgeConfig()
            if args.use_vllm:
                raise ValueError("use_vllm must be False: the rows come from rollwire, sampled by its engines")
            if args.num_iterations != 1 or args.steps_per_generation != 1:
                raise ValueError("num_iterations and steps_per_generation must be 1: one source batch is one "
                                 "optimizer step, pushed to the engines before the next")
            if args.beta != 0.0:
                raise ValueError("beta must be 0 (no reference model: the rows carry no reference logprobs)")
            if bridge.proxy_url and bridge.out is None:
                raise ValueError("TrlBridgeConfig.out must name the checkpoints' folder when proxy_url is set")
            placeholders = Dataset.from_dict({"prompt": [""] * args.generation_batch_size})
            super().__init__(model=model, reward_funcs=_no_reward, args=args, train_dataset=placeholders,
                             processing_class=processing_class, callbacks=[AfterStep(self)])
            self.source = source
            self.bridge = bridge
            self.policy = policy or (PolicyClient(bridge.proxy_url) if bridge.proxy_url else None)
            self.counts = RowCounts()
            self.steps: list[BridgeStep] = []
            self.version = bridge.start_version
            self.on_step = on_step
            self._pending: BridgeStep | None = None
            self._last_loss = math.nan
            self.last_rows: list[Row] = []
            self.last_inputs: dict[str, Any] = {}
            """The last step's rows and the inputs TRL's loss got from them, in row order (for checks)."""

        # -- rows in ------------------------------------------------------------------------------------
        def _next_usable(self) -> list[Row]:
            for _ in range(self.bridge.max_empty_batches):
                rows = self.source.next_rows()
                if rows is None:
                    raise SourceDone()
                kept = usable_rows(rows, self.counts, max_length=self.bridge.max_length,
                                   min_group_sessions=self.bridge.min_group_sessions)
                if kept:
                    return kept
                self.source.done(None)  # nothing to train on: passed over, acknowledged
            raise SourceDone()

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            rows = self._next_usable()
            device = self.accelerator.device
            pad = getattr(self.processing_class, "pad_token_id", None) or 0
            width = max(len(r) for r in rows)
            split = max(1, min(int(r.loss_mask.argmax()) for r in rows))
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attention = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            rollout = torch.zeros((len(rows), width), dtype=torch.float32)
            for i, row in enumerate(rows):
                n = len(row)
                ids[i, :n] = torch.from_numpy(row.input_ids)
                attention[i, :n] = 1
                mask[i, :n] = torch.from_numpy(row.loss_mask.astype("int64"))
                rollout[i, :n] = torch.from_numpy(row.logprobs)
            ids, attention, mask, rollout = (t.to(device) for t in (ids, attention, mask, rollout))
            advantage = torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device)
            keep = width - split
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention, keep)
            trained = mask[:, split:].float()
            behaviour = torch.exp((old - rollout[:, split:]) * trained)
            weight = torch.clamp(behaviour, max=self.bridge.is_cap)
            tokens = trained.sum().clamp(min=1)
            on = trained.bool()
            rewards = [r.reward for r in rows if not math.isnan(r.reward)]
            self._pending = BridgeStep(
                step=len(self.steps) + 1, rows=len(rows), groups=len({r.group_id for r in rows}),
                trained_tokens=int(trained.sum()), masked_tokens=int(attention.sum() - trained.sum()),
                is_ratio_mean=float((behaviour * trained).sum() / tokens), is_ratio_min=float(behaviour[on].min()),
                is_ratio_max=float(behaviour[on].max()),
                is_truncated=float(((behaviour > self.bridge.is_cap).float() * trained).sum() / tokens),
                reward_mean=sum(rewards) / len(rewards) if rewards else None)
            self._log_metric("rollwire/is_ratio_mean", self._pending.is_ratio_mean)
            self.last_rows = rows
            self.last_inputs = {
                "prompt_ids": ids[:, :split], "prompt_mask": attention[:, :split],
                "completion_ids": ids[:, split:], "completion_mask": attention[:, split:],
                "tool_mask": mask[:, split:], "advantages": advantage[:, None] * weight * trained,
                "old_per_token_logps": old, "num_items_in_batch": trained.sum(),
            }
            return self.last_inputs

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self._last_loss = float(loss.detach())
            return loss

        # -- weights out --------------------------------------------------------------------------------
        def after_step(self) -> None:
            """Save, push as the next version, tell the source (version, acknowledgement); one line."""
            step = self._pending
            if step is None:
                return
            self._pending = None
            step.loss = self._last_loss
            version = self.version + 1
            started = time.monotonic()
            if self.bridge.out is not None:
                model = self.accelerator.unwrap_model(self.model)
                step.checkpoint = save_checkpoint(model, self.bridge.out, version)
                if self.policy is not None:
                    self.policy.push(step.checkpoint, version, self.bridge.drain_timeout_s)
                prune_checkpoints(self.bridge.out, self.bridge.keep_checkpoints)
            step.sync_s = time.monotonic() - started
            self.version = version
            step.policy_version = version
            self.source.done(version)
            step.counts = self.counts.as_dict()
            self.steps.append(step)
            if self.on_step is not None:
                self.on_step(step)

        def train(self, *args: Any, **kwargs: Any) -> Any:
            """TRL's training loop, ended early (cleanly) when the source has no more rows."""
            try:
                return super().train(*args, **kwargs)
            except SourceDone:
                return None

    return RollwireGRPOTrainer


def rollwire_grpo_trainer(model: Any, tokenizer: Any, source: RowSource, args: Any,
                          bridge: TrlBridgeConfig | None = None, on_step: Any = None) -> Any:
    """A ``RollwireGRPOTrainer`` (TRL's ``GRPOTrainer``) over ``source``; ``on_step(BridgeStep)`` after
    each step's push."""
    return grpo_trainer_class()(model, tokenizer, source, args, bridge=bridge, on_step=on_step)
