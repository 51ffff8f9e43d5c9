"""Compact numeric arrays for events: token ids, logprobs and loss masks.

A completion carries hundreds of thousands of numbers. As JSON number lists they cost about 18 bytes per
sampled token on Kafka even after zstd; packed they cost under 9. The wire form is a JSON string, so an
event stays one JSON document that any language can read with its JSON Schema:

    "<dtype>:<base64>"      e.g.  "i4:AQAAAAIAAAA..."  or  "f4:..."  or  "u1:..."

- ``dtype`` is one of ``i4`` (int32), ``f4`` (float32), ``f8`` (float64), ``u1`` (uint8).
- The payload is the little-endian array, **byte-shuffled** (all first bytes of every element, then all
  second bytes, and so on) and then base64 (standard alphabet, with padding). Shuffling puts the nearly
  constant high bytes of token ids and of the logprobs' sign/exponent side by side, which is what lets
  the producer's zstd squeeze them. Width-1 dtypes are not shuffled (it would change nothing).

Logprobs are stored as float32 when every value survives the float32 round trip exactly (vLLM computes
them in float32, so this is the normal case) and as float64 otherwise: the codec never rounds. A missing
logprob is NaN; deciding whether that is an error belongs to the consumer (trajectory builders report it).
"""

from __future__ import annotations

import binascii
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import pybase64
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from schemas.errors import SchemaError

_DTYPES: dict[str, np.dtype] = {
    "i4": np.dtype("<i4"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
    "u1": np.dtype("u1"),
}


class ArrayCodecError(SchemaError, ValueError):
    """A packed array string is malformed or holds values its type does not allow."""


def _shuffle(raw: bytes, width: int) -> bytes:
    if width == 1 or not raw:
        return raw
    elements = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width)
    planes = np.empty((width, elements.shape[0]), dtype=np.uint8)
    for byte in range(width):  # one strided pass per byte: about 3x numpy's transposed copy
        planes[byte] = elements[:, byte]
    return planes.tobytes()


def _unshuffle(raw: bytes, width: int) -> np.ndarray:
    """The shuffled bytes back in element order, as a fresh (writable) uint8 array."""
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, -1)
    elements = np.empty((planes.shape[1], width), dtype=np.uint8)
    for byte in range(width):
        elements[:, byte] = planes[byte]
    return elements


# dtype -> code, by the dtype's string (a dict lookup; comparing np.dtype objects one by one cost more).
_CODES: dict[str, str] = {dtype.str: code for code, dtype in _DTYPES.items()}
_CODES["|u1"] = "u1"


def _code_of(dtype: np.dtype) -> str | None:
    return _CODES.get(dtype.str)


def encode_array(values: np.ndarray) -> str:
    """Pack a 1-D array of a supported dtype into its wire string."""
    code = _code_of(values.dtype)
    if code is None:
        raise ArrayCodecError(f"unsupported dtype {values.dtype}; use one of {sorted(_DTYPES)}")
    dtype = _DTYPES[code]
    raw = np.ascontiguousarray(values).tobytes()
    return f"{code}:{pybase64.b64encode_as_string(_shuffle(raw, dtype.itemsize))}"


def decode_array(text: str) -> np.ndarray:
    """Unpack a wire string into a read-only 1-D array; raises ArrayCodecError when malformed."""
    code, sep, payload = text.partition(":")
    dtype = _DTYPES.get(code)
    if not sep or dtype is None:
        raise ArrayCodecError(f"packed array must start with one of {sorted(_DTYPES)} and ':', "
                              f"got {text[:12]!r}")
    try:
        # validate=True: the alphabet and the padding are checked (pybase64: SIMD, the checks included).
        raw = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ArrayCodecError(f"packed {code} array is not valid base64: {exc}") from exc
    if len(raw) % dtype.itemsize:
        raise ArrayCodecError(f"packed {code} array has {len(raw)} bytes, not a multiple of {dtype.itemsize}")
    if dtype.itemsize == 1 or not raw:
        array = np.frombuffer(raw, dtype=dtype)
    else:
        array = _unshuffle(raw, dtype.itemsize).view(dtype).reshape(-1)
    array.flags.writeable = False
    return array


class PackedArray(Sequence):
    """An immutable 1-D numeric array that serializes to the compact wire string.

    Subclasses fix which dtypes are allowed. Construct from a list, a numpy array or the wire string.
    Equality compares values (NaN equals NaN, so a decoded event equals the one that was sent).
    """

    allowed: ClassVar[tuple[str, ...]] = ()
    json_description: ClassVar[str] = ""
    __slots__ = ("_array",)

    def __init__(self, values: Iterable[Any] | np.ndarray | str | PackedArray) -> None:
        self._array = self._coerce(values)

    @classmethod
    def _coerce(cls, values: Any) -> np.ndarray:
        if isinstance(values, PackedArray):
            array = values._array
        elif isinstance(values, str):
            array = decode_array(values)
        else:
            array = cls._from_values(values)
        if array.ndim != 1:
            raise ArrayCodecError(f"{cls.__name__} must be one-dimensional, got shape {array.shape}")
        if _code_of(array.dtype) not in cls.allowed:
            raise ArrayCodecError(f"{cls.__name__} holds {'/'.join(cls.allowed)} values, got {array.dtype}")
        if not array.flags.writeable:
            return array
        array = array.copy()
        array.flags.writeable = False
        return array

    @classmethod
    def _from_values(cls, values: Any) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- sequence protocol -------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._array.shape[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return type(self)(self._array[index])
        return self._array[index].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._array.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            other_array = other._array
        elif isinstance(other, (list, tuple, np.ndarray)):
            other_array = np.asarray(other)
        else:
            return NotImplemented
        if other_array.shape != self._array.shape:
            return False
        return bool(np.array_equal(self._array, other_array, equal_nan=self._array.dtype.kind == "f"))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value type; not a dict key

    def __repr__(self) -> str:
        head = self._array[:6].tolist()
        more = f", … {len(self) - 6} more" if len(self) > 6 else ""
        return f"{type(self).__name__}({head}{more}, dtype={self._array.dtype})"

    @property
    def numpy(self) -> np.ndarray:
        """The values as a read-only numpy array (no copy)."""
        return self._array

    def tolist(self) -> list[Any]:
        return self._array.tolist()

    def encode(self) -> str:
        return encode_array(self._array)

    # -- pydantic integration ----------------------------------------------------------------------
    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(value: Any) -> PackedArray:
            if isinstance(value, cls):
                return value
            try:
                return cls(value)
            except (ArrayCodecError, TypeError, OverflowError) as exc:
                raise ValueError(str(exc)) from exc

        def serialize(value: Any, info: core_schema.SerializationInfo) -> Any:
            # model_copy(update=...) skips validation, so a raw list or ndarray can arrive here.
            packed = value if isinstance(value, PackedArray) else cls(value)
            return packed.encode() if info.mode_is_json() else packed

        return core_schema.no_info_plain_validator_function(
            validate,
            serialization=core_schema.plain_serializer_function_ser_schema(serialize, info_arg=True),
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        codes = "|".join(cls.allowed)
        return {
            "type": "string",
            "pattern": rf"^({codes}):[A-Za-z0-9+/]*={{0,2}}$",
            "contentEncoding": "base64",
            "description": cls.json_description
            + " Wire form '<dtype>:<base64>': the little-endian array, byte-shuffled (all first bytes, then"
            " all second bytes, ...), base64-encoded. See schemas/arrays.py.",
        }


class TokenIds(PackedArray):
    """Token ids as the engine saw or sampled them (int32)."""

    allowed = ("i4",)
    json_description = "Token ids (int32)."

    @classmethod
    def _from_values(cls, values: Any) -> np.ndarray:
        array = np.asarray(values if isinstance(values, np.ndarray) else list(values))
        if array.size == 0:
            return np.zeros(0, dtype="<i4")
        if array.dtype.kind not in "iu":
            raise ArrayCodecError(f"token ids must be integers, got {array.dtype}")
        if array.min() < 0 or array.max() > np.iinfo(np.int32).max:
            raise ArrayCodecError("token ids must be in [0, 2**31)")
        return array.astype("<i4")


class Logprobs(PackedArray):
    """Log-probabilities of sampled tokens; float32 when exact, float64 otherwise; NaN means missing."""

    allowed = ("f4", "f8")
    json_description = "Log-probabilities (float32 when exact, else float64); NaN marks a missing value."

    @classmethod
    def _from_values(cls, values: Any) -> np.ndarray:
        if isinstance(values, np.ndarray):
            array = values
        else:
            array = np.asarray([np.nan if v is None else v for v in values], dtype="<f8")
        if array.size == 0:
            return np.zeros(0, dtype="<f4")
        if array.dtype.kind != "f":
            array = array.astype("<f8")
        if array.dtype == np.float32:
            return array.astype("<f4")
        with np.errstate(over="ignore"):  # values beyond float32's range simply stay float64
            narrow = array.astype("<f4")
        # Never round: keep float64 unless every value survives float32 exactly.
        if np.array_equal(narrow.astype(array.dtype), array, equal_nan=True):
            return narrow
        return array.astype("<f8")


class LossMask(PackedArray):
    """Per-token training mask (uint8; 1 = trained on, 0 = context)."""

    allowed = ("u1",)
    json_description = "Loss mask (uint8: 1 trained, 0 context)."

    @classmethod
    def _from_values(cls, values: Any) -> np.ndarray:
        array = np.asarray(values if isinstance(values, np.ndarray) else list(values))
        if array.size == 0:
            return np.zeros(0, dtype="u1")
        if array.dtype.kind not in "iub" or array.min() < 0 or array.max() > 1:
            raise ArrayCodecError("loss mask values must be 0 or 1")
        return array.astype("u1")
