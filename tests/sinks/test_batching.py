"""Padding and packing of training sequences (pure): shapes, masks, logprobs and advantages line up."""

from __future__ import annotations

import numpy as np
import pytest

from sinks.batching import (
    BudgetError,
    TrainingSequence,
    pack_sequences,
    packed_cost,
    packed_rows,
    pad_sequences,
    padded_cost,
)


def _sequence(length: int, prompt: int, advantage: float, name: str, missing: int = 0) -> TrainingSequence:
    tokens = np.arange(100, 100 + length, dtype=np.int32)
    mask = np.r_[np.zeros(prompt), np.ones(length - prompt)].astype(np.uint8)
    logprobs = np.where(mask == 1, -0.25, np.nan).astype(np.float32)
    if missing:
        logprobs[-missing:] = np.nan  # sampled tokens whose logprob the engine did not return
    return TrainingSequence(tokens, mask, logprobs, advantage, f"s-{name}", "task", "g", f"t-{name}",
                            f"s-{name}/0")


def test_padding_right_pads_to_the_longest_and_masks_context() -> None:
    a, b = _sequence(6, 2, 0.5, "a"), _sequence(4, 1, -1.0, "b")
    arrays = pad_sequences([a, b], pad_token_id=7)
    assert arrays.shape == (2, 6)
    assert arrays.input_ids[1].tolist() == [100, 101, 102, 103, 7, 7]
    assert arrays.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert arrays.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    # Rollout logprobs are 0 (not NaN) wherever the loss mask is 0, so a trainer can multiply freely.
    assert not np.isnan(arrays.logprobs).any()
    assert arrays.logprobs[0].tolist() == [0, 0, -0.25, -0.25, -0.25, -0.25]
    assert arrays.advantages[1].tolist() == [0, -1, -1, -1, 0, 0]
    assert arrays.position_ids[1].tolist() == [0, 1, 2, 3, 0, 0]
    assert arrays.segment_ids.tolist() == [[1] * 6, [2, 2, 2, 2, 0, 0]]
    assert padded_cost([6, 4]) == arrays.input_ids.size


def test_pad_to_multiple_rounds_the_width_up() -> None:
    arrays = pad_sequences([_sequence(5, 1, 1.0, "a")], pad_to_multiple_of=8)
    assert arrays.shape == (1, 8)
    assert padded_cost([5], 8) == 8


def test_packing_restarts_positions_and_separates_segments() -> None:
    sequences = [_sequence(5, 2, 1.0, "a"), _sequence(3, 1, -1.0, "b"), _sequence(6, 3, 0.5, "c")]
    arrays = pack_sequences(sequences, row_tokens=8)
    # First fit: a (5) + b (3) fill row 0; c (6) opens row 1. Rows are padded to the longest row.
    assert arrays.shape == (2, 8)
    assert arrays.segment_ids[0].tolist() == [1, 1, 1, 1, 1, 2, 2, 2]
    assert arrays.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert arrays.segment_ids[1].tolist() == [3] * 6 + [0, 0]
    assert arrays.advantages[0].tolist() == [0, 0, 1, 1, 1, 0, -1, -1]
    assert [(s.row, s.start, s.end) for s in arrays.spans] == [(0, 0, 5), (0, 5, 8), (1, 0, 6)]
    assert packed_cost([5, 3, 6], 8) == arrays.input_ids.size
    # The tokens of each sequence are recovered from its span.
    for sequence, span in zip(sequences, arrays.spans, strict=True):
        assert arrays.input_ids[span.row, span.start:span.end].tolist() == sequence.token_ids.tolist()


def test_a_sequence_longer_than_a_row_gets_its_own_row() -> None:
    assert packed_rows([3, 12, 2], 8) == [[0, 2], [1]]
    arrays = pack_sequences([_sequence(3, 1, 1.0, "a"), _sequence(12, 1, 1.0, "b")], row_tokens=8)
    assert arrays.shape == (2, 12)


def test_missing_rollout_logprobs_leave_the_loss_mask() -> None:
    arrays = pad_sequences([_sequence(6, 2, 1.0, "a", missing=2)])
    assert arrays.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0]
    assert arrays.advantages[0].tolist() == [0, 0, 1, 1, 0, 0]
    assert arrays.missing_logprobs == 2


def test_misaligned_sequence_and_empty_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="same length"):
        TrainingSequence(np.zeros(3, np.int32), np.zeros(2, np.uint8), np.zeros(3, np.float32), 0.0,
                         "s", "t", "g", "j", "s/0")
    with pytest.raises(BudgetError):
        packed_rows([1], 0)
