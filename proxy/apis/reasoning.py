"""One codec for reasoning round trips: the engine's reasoning handed to a harness as an opaque value,
read back exactly when the harness sends its history.

Three provider APIs carry such a value, and all three use this codec: Anthropic Messages' thinking
``signature``, Gemini's ``thoughtSignature`` and OpenAI Responses' ``encrypted_content``. Recovering the
reasoning from the value (instead of trusting echoed text) keeps the next prompt exactly what the engine
produced, so that it extends the previous prompt by prefix.

**The format** (version 2, the only one written): standard base64, with padding, of ::

    MAGIC (6 bytes) | VERSION (1 byte: 2) | CHECKSUM (8 bytes) | zlib stream of the UTF-8 text

``MAGIC`` is the 6 bytes that base64 renders as the text ``rollwire``, so every value begins with that
word and a value is recognised as ours without decoding it. ``CHECKSUM`` is the first 8 bytes of the
SHA-256 of the UTF-8 text; it detects values a client trimmed or damaged (it is no protection against
someone who forges a value on purpose: that person could only inject reasoning into their own prompt).
Standard base64 is what Google's SDKs require of ``thoughtSignature`` (a ``bytes`` field); Anthropic and
Responses accept any opaque ASCII string, so one framing serves all three APIs.

**Older formats** are still read (recorded fixtures and live sessions hold them), through the same
bounded path, and never written: Anthropic's ``rwt1.`` + base64(zlib(text)); Gemini's base64 of
``rw1`` + zlib(text) (recognised by its base64 text ``cncxeJ``: the magic and zlib's default header);
Responses' ``rwr1.`` + urlsafe base64(text) + ``.`` + 16 hex digits of SHA-256(text).

**Decoding rules**, the same for every API:

- A value that is not ours (a real Anthropic, Gemini or OpenAI one) decodes to None: the caller falls
  back to the visible reasoning text, if any.
- A value that claims to be ours (one of the prefixes above) but cannot be read — not ASCII, bad base64,
  an unknown version, a checksum mismatch, a damaged or truncated zlib stream, bytes that are not UTF-8,
  over a size limit — is a :class:`~proxy.errors.BadRequest` (HTTP 400) that names the field (``param``).
  Nothing else ever leaves :func:`decode_reasoning`.

**Limits.** Inflating is bounded, so a small body cannot make the proxy build gigabytes:

- :data:`ITEM_LIMIT` (1 MiB) of text per value: about 250k tokens, more than any one turn of reasoning.
- :data:`REQUEST_LIMIT` (8 MiB) of text for all the values of one request together, counted by a
  :class:`ReasoningBudget` that each parse creates and passes down. 8 MiB is the Kafka record limit
  (``schemas.topics.MAX_MESSAGE_BYTES``): the completion event holds the request's messages, reasoning
  included, so a request whose reasoning alone inflates past it could never be recorded anyway.
- A claimed value longer than :data:`ENCODED_LIMIT` characters is refused before any decoding: no value
  of ours can be longer (incompressible text of :data:`ITEM_LIMIT` bytes, base64-encoded).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import zlib
from dataclasses import dataclass

from proxy.errors import BadRequest

ITEM_LIMIT = 1 << 20
"""Most bytes of UTF-8 text one reasoning value may inflate to."""
REQUEST_LIMIT = 8 << 20
"""Most bytes of UTF-8 text all the reasoning values of one request may inflate to together."""
ENCODED_LIMIT = (ITEM_LIMIT + 4096) * 4 // 3 + 64
"""Longest value (characters) that can be ours: ITEM_LIMIT bytes that do not compress, base64-encoded."""

PREFIX = "rollwire"
"""The base64 text every value of the current format begins with."""
MAGIC = base64.b64decode(PREFIX)
FORMAT_VERSION = 2
CHECKSUM_BYTES = 8
_HEADER_BYTES = len(MAGIC) + 1 + CHECKSUM_BYTES

# Older formats: read, never written.
_ANTHROPIC_V1 = "rwt1."
_RESPONSES_V1 = "rwr1."
_GEMINI_V1 = "cncxeJ"  # base64 of b"rw1" + zlib's default header (0x78 0x9c)
_GEMINI_V1_MAGIC = b"rw1"
_RESPONSES_V1_DIGEST = 16


@dataclass
class ReasoningBudget:
    """How many bytes of text the reasoning values of one request may still inflate to.

    Create one per request parse and pass it to every :func:`decode_reasoning` of that request."""

    remaining: int = REQUEST_LIMIT

    def allowance(self) -> int:
        """The most bytes the next value may inflate to."""
        return max(0, min(ITEM_LIMIT, self.remaining))

    def charge(self, size: int) -> None:
        self.remaining -= size


def encode_reasoning(text: str) -> str:
    """The opaque value that stands for ``text`` (plain standard base64, ASCII, beginning ``rollwire``)."""
    data = text.encode("utf-8")
    header = MAGIC + bytes([FORMAT_VERSION]) + hashlib.sha256(data).digest()[:CHECKSUM_BYTES]
    return base64.b64encode(header + zlib.compress(data)).decode("ascii")


def is_ours(value: str) -> bool:
    """Whether ``value`` claims to be a reasoning value this proxy made (in any format)."""
    return value.startswith((PREFIX, _ANTHROPIC_V1, _RESPONSES_V1, _GEMINI_V1))


def decode_reasoning(value: str, *, param: str, budget: ReasoningBudget | None = None) -> str | None:
    """The reasoning text ``value`` stands for; None when the value is not ours.

    ``param`` names the field in errors (e.g. ``messages.3.content.0.signature``); ``budget`` is the
    request's (a fresh one when omitted). Raises BadRequest, and only that, for a damaged value of ours.
    """
    if not isinstance(value, str) or not is_ours(value):
        return None
    budget = budget if budget is not None else ReasoningBudget()
    if not value.isascii():
        raise _damaged(param, "it holds characters that are not ASCII")
    if len(value) > ENCODED_LIMIT:
        raise BadRequest(f"{param}: reasoning value of {len(value)} characters is longer than any this proxy "
                         f"makes (at most {ENCODED_LIMIT})", param=param)
    if value.startswith(PREFIX):
        text = _decode_current(value, param, budget)
    elif value.startswith(_ANTHROPIC_V1):
        text = _utf8(_inflate(_base64(value[len(_ANTHROPIC_V1):], param), param, budget), param)
    elif value.startswith(_RESPONSES_V1):
        text = _decode_responses_v1(value, param, budget)
    else:
        raw = _base64(value, param)
        text = _utf8(_inflate(raw[len(_GEMINI_V1_MAGIC):], param, budget), param)
    return text


# -- the formats ---------------------------------------------------------------------------------------

def _decode_current(value: str, param: str, budget: ReasoningBudget) -> str:
    raw = _base64(value, param)
    if len(raw) < _HEADER_BYTES:
        raise _damaged(param, "it is truncated")
    version = raw[len(MAGIC)]
    if version != FORMAT_VERSION:
        raise _damaged(param, f"unknown format version {version}")
    checksum = raw[len(MAGIC) + 1:_HEADER_BYTES]
    data = _inflate(raw[_HEADER_BYTES:], param, budget)
    if hashlib.sha256(data).digest()[:CHECKSUM_BYTES] != checksum:
        raise _damaged(param, "checksum mismatch")
    return _utf8(data, param)


def _decode_responses_v1(value: str, param: str, budget: ReasoningBudget) -> str:
    body, dot, digest = value[len(_RESPONSES_V1):].rpartition(".")
    if not dot or len(digest) != _RESPONSES_V1_DIGEST:
        raise _damaged(param, "no checksum")
    data = _base64(body, param, urlsafe=True)
    _charge(len(data), param, budget)
    if hashlib.sha256(data).hexdigest()[:_RESPONSES_V1_DIGEST] != digest:
        raise _damaged(param, "checksum mismatch")
    return _utf8(data, param)


# -- bounded steps -------------------------------------------------------------------------------------

def _base64(text: str, param: str, *, urlsafe: bool = False) -> bytes:
    try:
        return base64.b64decode(text, altchars=b"-_" if urlsafe else None, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _damaged(param, "it is not valid base64") from exc


def _inflate(data: bytes, param: str, budget: ReasoningBudget) -> bytes:
    """The zlib stream ``data`` inflated, never past the budget's allowance; charges what it produced."""
    allowance = budget.allowance()
    inflater = zlib.decompressobj()
    try:
        # One byte past the allowance: producing it proves the text is over the limit.
        text = inflater.decompress(data, allowance + 1)
    except zlib.error as exc:
        raise _damaged(param, "its compressed data is corrupt") from exc
    if len(text) > allowance:
        raise _over_limit(param, budget)
    if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise _damaged(param, "its compressed data is truncated or has trailing bytes")
    budget.charge(len(text))
    return text


def _charge(size: int, param: str, budget: ReasoningBudget) -> None:
    if size > budget.allowance():
        raise _over_limit(param, budget)
    budget.charge(size)


def _utf8(data: bytes, param: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _damaged(param, "its text is not UTF-8") from exc


def _damaged(param: str, why: str) -> BadRequest:
    return BadRequest(f"{param}: reasoning value made by this proxy is damaged ({why}); send it back exactly "
                      "as it was received, or drop the block", param=param)


def _over_limit(param: str, budget: ReasoningBudget) -> BadRequest:
    if budget.remaining < ITEM_LIMIT:
        return BadRequest(f"{param}: the reasoning values of this request inflate to more than {REQUEST_LIMIT} "
                          "bytes in all", param=param)
    return BadRequest(f"{param}: reasoning value inflates to more than {ITEM_LIMIT} bytes", param=param)
