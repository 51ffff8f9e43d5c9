"""Adapters for TRL's async GRPO trainer (``trl.experimental.async_grpo.AsyncGRPOTrainer``), for users on
GPUs: its rollout-worker protocol fed by the trainer feed, and its weight-transfer protocol as rollwire's
policy API.

    trainer = AsyncGRPOTrainer(model=..., args=..., rollout_worker=FeedRolloutWorker(FeedRows(feed)),
                               weight_transfer=PolicyApiWeightTransfer(proxy_url, Path("ckpt"), model.config))

``AsyncGRPOTrainer`` needs CUDA (FlashAttention "tree" kernels, and its default NCCL weight transfer):
these adapters run under it on a GPU machine only. What they do is tested on CPU (the sample conversion,
the checkpoint written and pushed); the async trainer itself is not run in rollwire's CI.

- :class:`FeedRolloutWorker`: a thread takes steps from a row source (:class:`sinks.bridges.trl.FeedRows`),
  applies the bad-input rules (sinks/bridges/rows.py) and queues one ``RolloutSample`` per row (per
  branch: a multi-branch session gives several samples under one ``group_id``): ``input_ids``,
  ``completion_mask`` = rollwire's loss mask, ``old_log_probs`` = the rollout logprobs (0 off the mask),
  ``advantage`` = rollwire's. A batch is acknowledged once queued (the async trainer consumes the queue
  on its own schedule and reports nothing per sample: a trainer that crashes loses what it had queued).
  ``update_model_version`` sets the feed's policy version, so staleness is measured against the version
  the engines serve.
- :class:`PolicyApiWeightTransfer`: ``send_weights`` writes the streamed tensors as a Hugging Face folder
  (``lm_head.weight`` stored even when tied, as sinks/trainer/checkpoints.py does) and pushes it with
  ``POST /v1/policy/weights`` as the next version; ``pause`` and ``resume`` do nothing, since the proxy
  holds new calls and drains the running ones itself.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sinks.bridges.rows import Row, RowCounts, usable_rows
from sinks.bridges.trl import RowSource
from sinks.trainer.checkpoints import CHECKPOINT_PREFIX, prune_checkpoints
from sinks.trainer.policy import PolicyClient

logger = logging.getLogger(__name__)


def rollout_sample(row: Row, model_version: int) -> Any:
    """One row as TRL's ``RolloutSample`` (imports TRL's async worker module, and so torch)."""
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    return RolloutSample(prompt=[], completion=[], input_ids=row.input_ids.astype(np.int64),
                         completion_mask=row.loss_mask.astype(np.int64),
                         old_log_probs=np.where(row.loss_mask == 1, row.logprobs, 0.0).astype(np.float32),
                         advantage=float(row.advantage), model_version=model_version,
                         group_id=zlib.crc32(row.group_id.encode()), metrics={}, enqueued_at=time.time())


class FeedRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` over a row source; see the module docstring."""

    def __init__(self, source: RowSource, *, max_length: int | None = None, min_group_sessions: int = 2,
                 max_queued: int = 1024) -> None:
        self.source = source
        self.max_length = max_length
        self.min_group_sessions = min_group_sessions
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self.metrics_queue: queue.Queue[Any] = queue.Queue()
        self.counts = RowCounts()
        self.model_version = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_put = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollwire-rollout-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                rows = self.source.next_rows()
                if rows is None:
                    return
                for row in usable_rows(rows, self.counts, max_length=self.max_length,
                                       min_group_sessions=self.min_group_sessions):
                    self._put(rollout_sample(row, self.model_version))
                self.source.done(None)
                self.metrics_queue.put({f"rollwire/{k}": float(v) for k, v in self.counts.as_dict().items()})
        except BaseException as exc:  # noqa: BLE001 - reported by check_health on the trainer's thread
            self._error = exc
            logger.exception("the rollout worker stopped")

    def _put(self, sample: Any) -> None:
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.5)
                self._last_put = time.monotonic()
                return
            except queue.Full:
                continue

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version
        feed = getattr(self.source, "feed", None)
        if feed is not None:
            feed.policy_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollwire rollout worker failed: {self._error!r}") from self._error
        if self._thread is not None and not self._thread.is_alive() and self.rollout_buffer.empty():
            raise RuntimeError("the rollwire rollout worker's source has no more rows")


class PolicyApiWeightTransfer:
    """TRL's ``WeightTransferProtocol`` as a checkpoint folder pushed through the proxy; see the module
    docstring. ``config``: the model's ``PretrainedConfig`` (written beside the weights)."""

    def __init__(self, proxy_url: str, out: Path, config: Any, *, start_version: int = 0,
                 keep_checkpoints: int = 2, drain_timeout_s: float = 600.0,
                 policy: PolicyClient | None = None) -> None:
        self.policy = policy or PolicyClient(proxy_url)
        self.out = Path(out)
        self.config = config
        self.version = start_version
        self.keep_checkpoints = keep_checkpoints
        self.drain_timeout_s = drain_timeout_s
        self.pushed: list[Path] = []

    def init_weight_transfer(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)

    def pause(self) -> None:
        return None  # the proxy holds new calls and drains the running ones during the push

    def resume(self) -> None:
        return None

    def destroy(self) -> None:
        return None

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Write the tensors as ``policy-v<next>`` and push it; returns once the engines serve it."""
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in iterator}
        if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        version = self.version + 1
        folder = self.out / f"{CHECKPOINT_PREFIX}{version}"
        staging = self.out / f".{folder.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        self.config.save_pretrained(staging)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        self.policy.push(folder, version, self.drain_timeout_s)
        self.version = version
        self.pushed.append(folder)
        prune_checkpoints(self.out, self.keep_checkpoints)
