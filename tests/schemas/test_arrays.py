"""Packed arrays: exact round trips, the wire form, and refusal of bad input."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.arrays import ArrayCodecError, Logprobs, LossMask, TokenIds, decode_array, encode_array

token_ids = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=600)
doubles = st.floats(allow_nan=True, allow_infinity=True, width=64)
float32s = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(token_ids)
def test_token_ids_round_trip_exactly(values: list[int]) -> None:
    packed = TokenIds(values)
    assert TokenIds(packed.encode()).tolist() == values


@given(st.lists(doubles, max_size=300))
def test_logprobs_never_rounded(values: list[float]) -> None:
    """Any float64 comes back bit-for-bit (NaN stays NaN): float32 is used only when exact."""
    decoded = Logprobs(Logprobs(values).encode()).tolist()
    assert len(decoded) == len(values)
    for got, want in zip(decoded, values):
        assert (math.isnan(got) and math.isnan(want)) or got == want


@given(st.lists(float32s, min_size=1, max_size=300))
def test_float32_logprobs_are_stored_in_four_bytes(values: list[float]) -> None:
    encoded = Logprobs(values).encode()
    assert encoded.startswith("f4:")
    assert len(base64.b64decode(encoded[3:])) == 4 * len(values)


def test_float64_only_values_keep_eight_bytes() -> None:
    assert Logprobs([-0.1]).encode().startswith("f8:")  # 0.1 is not a float32
    assert Logprobs([-0.1]).tolist() == [-0.1]


def test_none_logprob_becomes_nan() -> None:
    assert math.isnan(Logprobs([-1.0, None]).tolist()[1])


def test_wire_form_is_byte_shuffled_little_endian() -> None:
    """The documented layout, so that another language can decode it: all low bytes, then the next."""
    encoded = TokenIds([1, 258]).encode()
    code, payload = encoded.split(":")
    assert code == "i4"
    assert base64.b64decode(payload) == bytes([1, 2, 0, 1, 0, 0, 0, 0])


@pytest.mark.parametrize("text, fragment", [
    ("i4", "must start with"),
    ("x9:AAAA", "must start with"),
    ("i4:!!!!", "not valid base64"),
    ("i4:AAA=", "not a multiple of 4"),
])
def test_malformed_wire_strings_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(ArrayCodecError, match=fragment):
        decode_array(text)


def test_dtype_is_checked_against_the_array_type() -> None:
    with pytest.raises(ArrayCodecError, match="TokenIds holds i4"):
        TokenIds(Logprobs([-1.0]).encode())


@pytest.mark.parametrize("values", [[-1], [2**31], [1.5]])
def test_token_ids_out_of_range_or_not_integers(values: list) -> None:
    with pytest.raises(ArrayCodecError):
        TokenIds(values)


def test_loss_mask_only_zero_or_one() -> None:
    assert LossMask([0, 1, 1]).encode().startswith("u1:")
    with pytest.raises(ArrayCodecError, match="0 or 1"):
        LossMask([0, 2])


def test_arrays_are_immutable_and_compare_by_value() -> None:
    ids = TokenIds(np.arange(5))
    with pytest.raises(ValueError):
        ids.numpy[0] = 9
    assert ids == [0, 1, 2, 3, 4]
    assert ids != [0, 1, 2, 3]
    assert ids[1:3] == TokenIds([1, 2])
    assert ids[4] == 4


def test_encode_refuses_unsupported_dtype() -> None:
    with pytest.raises(ArrayCodecError, match="unsupported dtype"):
        encode_array(np.zeros(3, dtype=np.int64))
