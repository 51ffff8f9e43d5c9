"""Run by verl's own interpreter (deploy/verl_env.py), never imported by rollwire: verl 0.9.1's own functions
on a batch rollwire's verl bridge wrote (sinks/bridges/verl.py), and what they computed written back.

    <verl env>/bin/python tests/sinks/verl_side.py BATCH.npz OUT.npz [--is-threshold 2.0]

The batch becomes a ``DataProto`` as the bridge's docstring says. Then, as verl's trainer runs them:

- ``verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories`` (GRPO; the v1 trainer's path for
  agent loops that return several outputs per session: GRPO over each session's final row, by ``uid``,
  broadcast to the session's other rows), on the bridge's ``row_keys``;
- ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` on every row as its own sample (what
  verl's v0 path would do with the same rows: a multi-branch session counted once per row);
- ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` with token-level
  TIS (``rollout_is: token``, ``rollout_is_threshold``), against the batch's ``old_log_probs`` (the
  trainer's logprobs, which the test lays out beside the bridge's fields).

OUT holds ``advantages`` (v1), ``advantages_per_row`` (v0), ``rollout_is_weights``, ``response_mask``
(after verl's rejection step: unchanged without ``rollout_rs``), and a JSON ``versions`` string.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
import transformers
import verl
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

TENSOR, NON_TENSOR = "tensor/", "non_tensor/"


def load(path: str) -> DataProto:
    with np.load(path, allow_pickle=False) as data:
        tensors = {k[len(TENSOR):]: torch.from_numpy(data[k]) for k in data.files if k.startswith(TENSOR)}
        non_tensors = {k[len(NON_TENSOR):]: data[k].astype(object) for k in data.files if k.startswith(NON_TENSOR)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("batch")
    parser.add_argument("out")
    parser.add_argument("--is-threshold", type=float, default=2.0)
    args = parser.parse_args()

    multi = load(args.batch)
    multi.batch.pop("advantages")  # rollwire's: verl computes its own here
    multi.batch.pop("returns")
    keys = [str(k) for k in multi.non_tensor_batch["row_keys"]]
    multi = compute_advantage_for_multi_trajectories(multi, keys, core_algos.AdvantageEstimator.GRPO)

    single = load(args.batch)
    per_row, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=single.batch["token_level_rewards"], response_mask=single.batch["response_mask"],
        index=single.non_tensor_batch["uid"])

    corrected, metrics = compute_rollout_correction_and_add_to_batch(
        load(args.batch), RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=args.is_threshold))

    versions = {"verl": verl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "python": sys.version.split()[0], "metrics": {k: float(v) for k, v in metrics.items()
                                                              if isinstance(v, (int, float))}}
    np.savez(args.out, advantages=multi.batch["advantages"].numpy(), advantages_per_row=per_row.numpy(),
             rollout_is_weights=corrected.batch["rollout_is_weights"].numpy(),
             response_mask=corrected.batch["response_mask"].numpy(), versions=np.array(json.dumps(versions)))
    print(json.dumps(versions))


if __name__ == "__main__":
    main()
