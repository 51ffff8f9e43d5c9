"""Training rows as a bridge hands them to a framework, and the rules for bad input (pure numpy).

A :class:`Row` is one trace of one sample: ``input_ids``, ``loss_mask`` (1 on the model's own sampled
tokens; 0 on the prompt, tool outputs and template glue), ``logprobs`` (the rollout engine's logprob of
each token, aligned with ``input_ids``; NaN where unknown) and the sample's ``advantage`` as rollwire
computed it (the groups worker's, times the feed's staleness weight). Rows come from a feed batch
(:func:`rows_of_batch`) or from an RL rows file (:func:`read_rl_rows`).

:func:`usable_rows` applies the rules a bridge documents, and counts each case in :class:`RowCounts`
instead of failing in the middle of a run:

- a trained token without a rollout logprob leaves the loss mask (no importance ratio can be formed);
  a row left with no trained token is dropped (``rows_without_logprobs`` when it had sampled tokens,
  ``rows_without_trained_tokens`` otherwise);
- a row longer than ``max_length`` is cut to its first ``max_length`` tokens (a causal prefix, mask and
  logprobs cut with it; ``rows_truncated``); a cut that leaves no trained token drops it;
- a row whose advantage is unknown (NaN) is dropped (``rows_without_advantage``);
- a group with fewer than ``min_group_sessions`` sessions left is dropped (``groups_too_small``): one
  sample has no baseline to be compared with. Sessions are counted, not rows, so a multi-branch
  session's traces count once and all of them stay.

Stale groups are the feed's to drop or down-weight (sinks/staleness.py, ``TrainerFeed.stats``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Row:
    """One trace of one sample, as trained on."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    advantage: float
    group_id: str = ""
    session_id: str = ""
    trace_id: str = ""
    reward: float = math.nan

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class RowCounts:
    """What :func:`usable_rows` passed over or changed, summed over a run."""

    rows: int = 0
    rows_used: int = 0
    rows_without_logprobs: int = 0
    rows_without_trained_tokens: int = 0
    rows_without_advantage: int = 0
    rows_truncated: int = 0
    groups_too_small: int = 0
    tokens_without_logprob: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return value.detach().to("cpu").numpy()  # a torch tensor


def rows_of_batch(batch: Any) -> list[Row]:
    """The rows of a padded feed batch (sinks.feed.Batch, numpy or torch), padding stripped. The feed has
    already taken tokens without a logprob out of the loss mask (``Batch.missing_logprobs``)."""
    if batch.packed:
        raise ValueError("the bridges take padded feed batches (BatchConfig(pack=False))")
    ids, attention = _numpy(batch.input_ids), _numpy(batch.attention_mask)
    mask, logprobs = _numpy(batch.loss_mask), _numpy(batch.logprobs)
    rows = []
    for r in range(ids.shape[0]):
        length = int(attention[r].sum())
        trained = mask[r, :length].astype(np.int8)
        rollout = np.where(trained == 1, logprobs[r, :length], np.nan).astype(np.float32)
        rows.append(Row(input_ids=ids[r, :length].astype(np.int64), loss_mask=trained, logprobs=rollout,
                        advantage=float(batch.sample_advantages[r]), group_id=batch.group_ids[r],
                        session_id=batch.session_ids[r], trace_id=batch.trace_ids[r],
                        reward=float(batch.sample_rewards[r]) if batch.sample_rewards else math.nan))
    return rows


def _fit(row: Row, max_length: int | None, counts: RowCounts) -> Row | None:
    mask = row.loss_mask.astype(np.int8)
    logprobs = row.logprobs.astype(np.float32)
    sampled = int(mask.sum())
    known = (mask == 1) & ~np.isnan(logprobs)
    counts.tokens_without_logprob += sampled - int(known.sum())
    mask = known.astype(np.int8)
    ids = row.input_ids
    if max_length is not None and len(ids) > max_length:
        counts.rows_truncated += 1
        ids, mask, logprobs = ids[:max_length], mask[:max_length], logprobs[:max_length]
    if not mask.any():
        if sampled and not known.any():
            counts.rows_without_logprobs += 1
        else:
            counts.rows_without_trained_tokens += 1
        return None
    if math.isnan(row.advantage):
        counts.rows_without_advantage += 1
        return None
    return Row(input_ids=ids, loss_mask=mask, logprobs=np.where(mask == 1, logprobs, 0.0).astype(np.float32),
               advantage=row.advantage, group_id=row.group_id, session_id=row.session_id, trace_id=row.trace_id,
               reward=row.reward)


def usable_rows(rows: list[Row], counts: RowCounts, *, max_length: int | None = None,
                min_group_sessions: int = 2) -> list[Row]:
    """The rows to train on, in order, after the module docstring's rules; ``counts`` is updated."""
    counts.rows += len(rows)
    fitted = [f for f in (_fit(r, max_length, counts) for r in rows) if f is not None]
    sessions: dict[str, set[str]] = {}
    for row in fitted:
        sessions.setdefault(row.group_id, set()).add(row.session_id)
    small = {g for g, members in sessions.items() if len(members) < min_group_sessions}
    counts.groups_too_small += len(small)
    kept = [r for r in fitted if r.group_id not in small]
    counts.rows_used += len(kept)
    return kept


# -- RL rows files: one JSON object a line -----------------------------------------------------------------

RL_ROW_FIELDS = ("input_ids", "loss_mask", "logprobs", "advantage", "group_id", "session_id", "trace_id", "reward")


def row_record(row: Row) -> dict[str, Any]:
    """A row as one JSON object of an RL rows file (NaN logprobs and rewards as null)."""
    def clean(values: np.ndarray) -> list[float | None]:
        return [None if math.isnan(v) else float(v) for v in values.tolist()]

    return {"input_ids": row.input_ids.tolist(), "loss_mask": row.loss_mask.tolist(), "logprobs": clean(row.logprobs),
            "advantage": None if math.isnan(row.advantage) else row.advantage, "group_id": row.group_id,
            "session_id": row.session_id, "trace_id": row.trace_id,
            "reward": None if math.isnan(row.reward) else row.reward}


def write_rl_rows(path: Path, rows: list[Row]) -> int:
    """Append rows to an RL rows file; returns how many were written."""
    with path.open("a", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row_record(row)) + "\n")
    return len(rows)


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def read_rl_rows(path: Path) -> Iterator[Row]:
    """The rows of an RL rows file in order (``input_ids``, ``loss_mask`` and ``advantage`` required;
    ``logprobs`` null or absent where unknown)."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            missing = [k for k in ("input_ids", "loss_mask") if k not in record]
            if missing:
                raise ValueError(f"{path}:{number}: an RL row needs {', '.join(missing)}")
            ids = np.asarray(record["input_ids"], dtype=np.int64)
            raw = record.get("logprobs") or [None] * len(ids)
            yield Row(input_ids=ids, loss_mask=np.asarray(record["loss_mask"], dtype=np.int8),
                      logprobs=np.asarray([_float(v) for v in raw], dtype=np.float32),
                      advantage=_float(record.get("advantage")), group_id=str(record.get("group_id", "")),
                      session_id=str(record.get("session_id", "")) or f"row-{number}",
                      trace_id=str(record.get("trace_id", "")), reward=_float(record.get("reward")))


@dataclass(slots=True)
class GroupedRows:
    """Rows of a file cut into steps of whole groups: ``groups_per_step`` groups each (a group's rows are
    consecutive in the file, as the feed and :func:`write_rl_rows` lay them)."""

    rows: Iterator[Row]
    groups_per_step: int = 1
    _held: list[Row] = field(default_factory=list)

    def next_step(self) -> list[Row] | None:
        """The next step's rows, or None when the file is done."""
        step, self._held = self._held, []
        groups = list(dict.fromkeys(r.group_id for r in step))
        for row in self.rows:
            if row.group_id not in groups:
                if len(groups) == self.groups_per_step:
                    self._held = [row]
                    return step
                groups.append(row.group_id)
            step.append(row)
        return step or None
