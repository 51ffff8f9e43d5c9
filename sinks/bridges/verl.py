"""verl's batch built from rollwire's rows: the tensors verl 0.9.1's trainer reads from a ``DataProto``, as
plain numpy arrays (no verl, no torch here: rollwire never depends on verl).

A verl process turns a :class:`VerlBatch` into its ``DataProto`` with::

    data = DataProto.from_dict(tensors={k: torch.from_numpy(v) for k, v in batch.tensors.items()},
                               non_tensors={k: v.astype(object) for k, v in batch.non_tensors.items()})

(:func:`save_npz` / :func:`load_npz` carry a batch between the two environments as one ``.npz`` file.)

Layout, one row per trace (a multi-branch session gives several rows, every one with the session's
advantage), as verl's agent loop lays its outputs out (``AgentLoopWorker._postprocess``):

- a row is split at its first trained token: ``prompts`` (``[B, P]``, left-padded) is what comes before
  it, ``responses`` (``[B, R]``, right-padded) the rest, tool outputs and template glue included;
- ``input_ids`` = ``prompts`` then ``responses`` (``[B, P + R]``), ``attention_mask`` 1 on real tokens,
  ``position_ids`` = ``clip(cumsum(attention_mask) - 1, 0)`` (verl's ``compute_position_id_with_mask``);
- ``response_mask`` (``[B, R]``): rollwire's loss mask over the response: 0 on tool outputs, template glue
  and padding (verl's v1 trainer copies it to ``loss_mask``);
- ``rollout_log_probs`` (``[B, R]``, float32): the engine's logprob of ``responses[b, t]``, 0 where the
  mask is 0 (verl reads it for ``algorithm.rollout_correction`` and ``bypass_mode``);
- ``token_level_rewards`` (``[B, R]``, float32): the session's reward at the row's last response token
  (where verl puts ``rm_scores``), 0 elsewhere; 0 when the reward is unknown (``reward_known`` False);
- ``advantages`` and ``returns`` (``[B, R]``, float32): rollwire's advantage (the groups worker's, times the
  feed's staleness weight) on every trained token, 0 elsewhere: what verl's ``compute_advantage`` would
  write, so a verl trainer that takes them skips its own estimator.

Non-tensors (``[B]`` string or bool arrays): ``uid`` (the GRPO group: rollwire's group id, verl's ``index``
for ``compute_grpo_outcome_advantage``), ``row_keys`` (``{uid}_{n}_{i}``: the n-th session of the batch,
its i-th row, the key format verl's v1 ``compute_advantage_for_multi_trajectories`` reads to find each
session's final row and broadcast its advantage), ``session_ids``, ``trace_ids``, ``reward_known``.

Bad input follows sinks/bridges/rows.py (:func:`~sinks.bridges.rows.usable_rows`), counted in
``VerlBatch.counts``: a trained token without a rollout logprob leaves ``response_mask``; a row left with
no trained token (a row without logprobs) is dropped; a row whose advantage is unknown is dropped; a group
with fewer than ``min_group_sessions`` sessions (one usable sample: verl's GRPO would give it mean 0 and
std 1, its raw reward as advantage, where rollwire's has no baseline and gives 0) is dropped whole.

Where verl and rollwire differ, and the bridge keeps rollwire's: a session that failed by the policy's
fault is in rollwire's group with advantage 0 and out of its baseline; verl's GRPO would put its reward in
the baseline. The batch carries rollwire's ``advantages``; the rewards are there for verl's own estimator,
which agrees with rollwire's on groups of scored samples (tests/sinks/test_verl_bridge.py checks it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sinks.bridges.rows import Row, RowCounts, usable_rows

TENSOR_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                 "rollout_log_probs", "token_level_rewards", "advantages", "returns")
NON_TENSOR_FIELDS = ("uid", "row_keys", "session_ids", "trace_ids", "reward_known")
_TENSOR, _NON_TENSOR = "tensor/", "non_tensor/"


@dataclass(slots=True)
class VerlBatch:
    """verl's batch fields as numpy arrays (the module docstring), and what building it passed over."""

    tensors: dict[str, np.ndarray]
    non_tensors: dict[str, np.ndarray]
    counts: RowCounts = field(default_factory=RowCounts)

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0]) if self.tensors else 0

    @property
    def trained_tokens(self) -> int:
        """Tokens with ``response_mask`` 1."""
        return int(self.tensors["response_mask"].sum()) if self.tensors else 0


def _split(row: Row) -> int:
    """Where the response starts: the row's first trained token."""
    return int(np.argmax(row.loss_mask == 1))


def _row_keys(rows: Sequence[Row]) -> list[str]:
    """``{uid}_{n}_{i}`` per row; ``n`` numbers the batch's sessions, so a session id's own underscores
    never reach verl's ``key.rsplit("_", 2)``."""
    sessions: dict[tuple[str, str], int] = {}
    seen: dict[tuple[str, str], int] = {}
    keys = []
    for row in rows:
        session = (row.group_id, row.session_id)
        number = sessions.setdefault(session, len(sessions))
        index = seen.get(session, 0)
        seen[session] = index + 1
        keys.append(f"{row.group_id}_{number}_{index}")
    return keys


def _responses(rows: Sequence[Row], starts: Sequence[int], response_mask: np.ndarray,
               values: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per-trace arrays aligned with ``input_ids``, laid out as the responses are (0 off the mask)."""
    out = np.zeros(response_mask.shape, dtype=np.float32)
    for b, (row, start) in enumerate(zip(rows, starts)):
        part = np.asarray(values[row.trace_id], dtype=np.float32)[start:len(row)]
        out[b, :len(part)] = np.where(response_mask[b, :len(part)] == 1, part, 0.0)
    return out


def lay_out(rows: Sequence[Row], *, pad_token_id: int = 0,
            per_token: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> VerlBatch:
    """verl's batch of rows that are already usable (each with a trained token and a known advantage).

    ``per_token``: more ``[B, R]`` float32 tensors, by name, each given per trace id as an array aligned
    with the row's ``input_ids`` (the trainer's own logprobs as ``old_log_probs``, a teacher's), laid out
    like ``rollout_log_probs``: the response part, 0 where ``response_mask`` is 0. KeyError when a row's
    trace has none."""
    if not rows:
        raise ValueError("no rows to lay out: every row was passed over (see VerlBatch.counts)")
    starts = [_split(row) for row in rows]
    width_p = max(starts)
    width_r = max(len(row) - start for row, start in zip(rows, starts))
    count = len(rows)
    prompts = np.full((count, width_p), pad_token_id, dtype=np.int64)
    responses = np.full((count, width_r), pad_token_id, dtype=np.int64)
    prompt_attention = np.zeros((count, width_p), dtype=np.int64)
    response_attention = np.zeros((count, width_r), dtype=np.int64)
    response_mask = np.zeros((count, width_r), dtype=np.int64)
    rollout = np.zeros((count, width_r), dtype=np.float32)
    rewards = np.zeros((count, width_r), dtype=np.float32)
    advantages = np.zeros((count, width_r), dtype=np.float32)
    known = np.zeros(count, dtype=bool)
    for b, (row, start) in enumerate(zip(rows, starts)):
        length = len(row) - start
        mask = row.loss_mask[start:].astype(np.int64)
        prompts[b, width_p - start:] = row.input_ids[:start]
        prompt_attention[b, width_p - start:] = 1
        responses[b, :length] = row.input_ids[start:]
        response_attention[b, :length] = 1
        response_mask[b, :length] = mask
        rollout[b, :length] = np.where(mask == 1, row.logprobs[start:], 0.0)
        advantages[b, :length] = np.where(mask == 1, np.float32(row.advantage), 0.0)
        known[b] = not np.isnan(row.reward)
        if known[b]:
            rewards[b, length - 1] = row.reward
    attention = np.concatenate([prompt_attention, response_attention], axis=1)
    extra = {name: _responses(rows, starts, response_mask, values) for name, values in (per_token or {}).items()}
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention, "position_ids": np.clip(np.cumsum(attention, axis=1) - 1, 0, None),
        "response_mask": response_mask, "rollout_log_probs": rollout, "token_level_rewards": rewards,
        "advantages": advantages, "returns": advantages.copy(), **extra,
    }
    non_tensors = {
        "uid": np.array([row.group_id for row in rows], dtype=str),
        "row_keys": np.array(_row_keys(rows), dtype=str),
        "session_ids": np.array([row.session_id for row in rows], dtype=str),
        "trace_ids": np.array([row.trace_id for row in rows], dtype=str),
        "reward_known": known,
    }
    return VerlBatch(tensors, non_tensors)


def to_verl(rows: Sequence[Row], *, counts: RowCounts | None = None, pad_token_id: int = 0,
            max_length: int | None = None, min_group_sessions: int = 2,
            per_token: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> VerlBatch:
    """verl's batch of rollwire's rows (a feed batch's: :func:`sinks.bridges.rows.rows_of_batch`), after the
    bad-input rules; ``counts`` (a new one when None) says what was passed over; ``per_token`` as
    :func:`lay_out`. ValueError when nothing is left."""
    counts = counts if counts is not None else RowCounts()
    kept = usable_rows(list(rows), counts, max_length=max_length, min_group_sessions=min_group_sessions)
    batch = lay_out(kept, pad_token_id=pad_token_id, per_token=per_token)
    batch.counts = counts
    return batch


def save_npz(batch: VerlBatch, path: Path) -> Path:
    """Write the batch as one ``.npz`` (no pickles: strings as unicode arrays) for a verl process."""
    arrays: dict[str, Any] = {_TENSOR + k: v for k, v in batch.tensors.items()}
    arrays.update({_NON_TENSOR + k: v for k, v in batch.non_tensors.items()})
    with Path(path).open("wb") as out:
        np.savez(out, **arrays)
    return Path(path)


def load_npz(path: Path) -> VerlBatch:
    """A batch written by :func:`save_npz` (its counts are not carried)."""
    with np.load(Path(path), allow_pickle=False) as data:
        tensors = {k[len(_TENSOR):]: data[k] for k in data.files if k.startswith(_TENSOR)}
        non_tensors = {k[len(_NON_TENSOR):]: data[k] for k in data.files if k.startswith(_NON_TENSOR)}
    return VerlBatch(tensors, non_tensors)


__all__ = ["NON_TENSOR_FIELDS", "TENSOR_FIELDS", "VerlBatch", "lay_out", "load_npz", "save_npz", "to_verl"]
