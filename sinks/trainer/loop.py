"""The online loop: the trainer's configuration, :class:`OnlineTrainer` (subscribe, step, save, push, set the
version, ack) and the per-step report and summary it prints."""

from __future__ import annotations

import importlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from schemas.api import PolicyState
from schemas.policy import version_number
from sinks.errors import TrainerError
from sinks.trainer.checkpoints import prune_checkpoints, save_checkpoint
from sinks.trainer.loss import UpdateStats, grpo_update
from sinks.trainer.policy import PolicyClient
from sinks.trainer.torch_env import import_torch

Stale = Literal["drop", "downweight"]


@dataclass(frozen=True)
class TrainerConfig:
    """What ``rollwire train`` takes; see the package docstring for the loop."""

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
    """The model, its optimizer and the proxy client; :meth:`run` is the loop of the package docstring."""

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
        from sinks.feed import BatchConfig, ReadConfig, StalenessConfig, TrainerFeed

        c = self.config
        batching = BatchConfig(token_budget=c.groups_per_step * c.group_size * c.max_seq_tokens,
                               max_groups=c.groups_per_step, pad_token_id=self.model.config.pad_token_id or 0,
                               tensors="torch", linger_s=c.linger_s, idle_timeout_s=c.idle_timeout_s)
        return TrainerFeed(ReadConfig(group_id=c.group_id), batching, settings=settings,
                           staleness=StalenessConfig(max_staleness=c.max_staleness, stale=c.stale),
                           policy_version=self.version)

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
