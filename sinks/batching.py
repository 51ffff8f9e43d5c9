"""Turning training sequences into rectangular arrays under a token budget: padding or packing (pure numpy).

A :class:`TrainingSequence` is one trace of one sample with its advantage. :func:`pad_sequences` puts one
sequence per row, right-padded to the longest; :func:`pack_sequences` concatenates sequences into rows of
at most ``row_tokens`` (first fit, in order), with ``position_ids`` restarting at every sequence and
``segment_ids`` telling sequences apart, so a trainer can keep attention inside each sequence
(flash-attention's varlen path reads the restarting position ids; an eager trainer builds a block-diagonal
mask from ``segment_ids``). Both return :class:`BatchArrays`, whose arrays line up token for token:

- ``input_ids`` (int64), ``attention_mask`` (1 = real token), ``position_ids`` (int64),
- ``loss_mask`` (1 = a sampled token with a rollout logprob: trained on),
- ``logprobs`` (float32: at ``[r, t]`` the rollout engine's logprob of the token it sampled there,
  ``input_ids[r, t]``, given the tokens before it; 0 where the loss mask is 0),
- ``advantages`` (float32 per token: the sample's advantage times its weight where the loss mask is 1,
  else 0; 0 too for a sequence whose advantage is not known, see ``TrainingSequence.advantage``),
- ``segment_ids`` (int32: 0 for padding, ``i + 1`` for the batch's i-th sequence).

A sampled token whose rollout logprob is missing (NaN) is taken out of the loss mask (no importance ratio
can be formed for it) and counted in ``BatchArrays.missing_logprobs``.

Nothing here knows about Kafka or torch; the trainer feed (sinks/feed.py) cuts batches of whole groups and
converts to torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sinks.errors import BudgetError as BudgetError


@dataclass(frozen=True, slots=True)
class TrainingSequence:
    """One trace of one sample, ready to be laid into a batch.

    ``advantage`` None: not known (a feed of trajectories without the group's advantage); ``weight``: the
    factor the feed applies to the advantage (staleness, sinks/staleness.py); ``oldest_version``: the
    oldest weight version of its trajectory (else of its group), from which the feed measures
    ``policy_lag`` when it lays the sequence into a batch.
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    advantage: float | None
    session_id: str
    task_id: str
    group_id: str
    trajectory_id: str
    trace_id: str
    reward: float | None = None
    weight: float = 1.0
    oldest_version: int | None = None
    policy_lag: int | None = None

    @property
    def weighted_advantage(self) -> float | None:
        """The advantage the batch carries: ``advantage * weight`` (None when the advantage is not known)."""
        return None if self.advantage is None else self.advantage * self.weight

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"trace {self.trace_id}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                             f"logprobs ({len(self.logprobs)}) must have the same length")

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """Where a sequence lies in the batch: row and half-open token range."""

    row: int
    start: int
    end: int


@dataclass(slots=True)
class BatchArrays:
    """A batch's arrays (see the module docstring) and, per sequence, where it lies."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    advantages: np.ndarray
    segment_ids: np.ndarray
    spans: list[SequenceSpan] = field(default_factory=list)
    missing_logprobs: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = self.input_ids.shape
        return rows, columns


def padded_cost(lengths: Sequence[int], pad_to_multiple_of: int = 1) -> int:
    """Tokens (padding included) that :func:`pad_sequences` lays out for sequences of these lengths."""
    if not lengths:
        return 0
    return len(lengths) * _round_up(max(lengths), pad_to_multiple_of)


def packed_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """First-fit packing of sequence indices into rows of at most ``row_tokens`` (a longer sequence gets a
    row of its own). Order is kept inside rows, so a batch reads in arrival order."""
    if row_tokens < 1:
        raise BudgetError(f"row_tokens must be at least 1, got {row_tokens}")
    rows: list[list[int]] = []
    used: list[int] = []
    for index, length in enumerate(lengths):
        for row, filled in enumerate(used):
            if filled + length <= row_tokens:
                rows[row].append(index)
                used[row] += length
                break
        else:
            rows.append([index])
            used.append(length)
    return rows


def packed_cost(lengths: Sequence[int], row_tokens: int, pad_to_multiple_of: int = 1) -> int:
    """Tokens (padding included) that :func:`pack_sequences` lays out for sequences of these lengths."""
    if not lengths:
        return 0
    rows = packed_rows(lengths, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    return len(rows) * _round_up(width, pad_to_multiple_of)


def pad_sequences(sequences: Sequence[TrainingSequence], pad_token_id: int = 0,
                  pad_to_multiple_of: int = 1) -> BatchArrays:
    """One sequence per row, right-padded to the longest (rounded up to ``pad_to_multiple_of``)."""
    layout = [[i] for i in range(len(sequences))]
    return _lay_out(sequences, layout, pad_token_id, pad_to_multiple_of)


def pack_sequences(sequences: Sequence[TrainingSequence], row_tokens: int, pad_token_id: int = 0,
                   pad_to_multiple_of: int = 1) -> BatchArrays:
    """Sequences concatenated into rows of at most ``row_tokens`` (first fit); rows are padded to the
    longest row, so a batch whose rows are short does not carry ``row_tokens`` of padding."""
    layout = packed_rows([len(s) for s in sequences], row_tokens)
    return _lay_out(sequences, layout, pad_token_id, pad_to_multiple_of)


def _round_up(n: int, multiple: int) -> int:
    if multiple < 1:
        raise BudgetError(f"pad_to_multiple_of must be at least 1, got {multiple}")
    return -(-n // multiple) * multiple


def _lay_out(sequences: Sequence[TrainingSequence], layout: list[list[int]], pad_token_id: int,
             pad_to_multiple_of: int) -> BatchArrays:
    width = max((sum(len(sequences[i]) for i in row) for row in layout), default=0)
    width = _round_up(width, pad_to_multiple_of)
    shape = (len(layout), width)
    input_ids = np.full(shape, pad_token_id, dtype=np.int64)
    attention_mask = np.zeros(shape, dtype=np.int64)
    position_ids = np.zeros(shape, dtype=np.int64)
    loss_mask = np.zeros(shape, dtype=np.int64)
    logprobs = np.zeros(shape, dtype=np.float32)
    advantages = np.zeros(shape, dtype=np.float32)
    segment_ids = np.zeros(shape, dtype=np.int32)
    spans: list[SequenceSpan | None] = [None] * len(sequences)
    missing = 0
    for row, indices in enumerate(layout):
        start = 0
        for index in indices:
            sequence = sequences[index]
            end = start + len(sequence)
            lp = np.asarray(sequence.logprobs, dtype=np.float32)
            mask = np.asarray(sequence.loss_mask).astype(bool)
            usable = mask & ~np.isnan(lp)
            missing += int(mask.sum() - usable.sum())
            input_ids[row, start:end] = sequence.token_ids
            attention_mask[row, start:end] = 1
            position_ids[row, start:end] = np.arange(len(sequence))
            loss_mask[row, start:end] = usable
            logprobs[row, start:end] = np.where(usable, lp, 0.0)
            advantage = sequence.weighted_advantage
            if advantage is not None:
                advantages[row, start:end] = np.where(usable, np.float32(advantage), 0.0)
            segment_ids[row, start:end] = index + 1
            spans[index] = SequenceSpan(row, start, end)
            start = end
    return BatchArrays(input_ids, attention_mask, position_ids, loss_mask, logprobs, advantages, segment_ids,
                       [s for s in spans if s is not None], missing)
