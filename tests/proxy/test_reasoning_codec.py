"""The reasoning codec on its own: round trips, the older formats, bounded decoding, and what a damaged
or foreign value becomes (BadRequest or None, never anything else)."""

from __future__ import annotations

import base64
import hashlib
import time
import zlib

import pytest
from hypothesis import given, settings, strategies as st

from proxy.errors import BadRequest
from proxy.apis.reasoning import (
    CHECKSUM_BYTES,
    FORMAT_VERSION,
    ITEM_LIMIT,
    MAGIC,
    PREFIX,
    REQUEST_LIMIT,
    ReasoningBudget,
    decode_reasoning,
    encode_reasoning,
)

PARAM = "messages.3.content.0.signature"


def frame(data: bytes, *, checksum_of: bytes | None = None, version: int = FORMAT_VERSION,
          compressed: bytes | None = None) -> str:
    """A value in the current format around arbitrary bytes (what a forger or a damaged client could send)."""
    digest = hashlib.sha256(data if checksum_of is None else checksum_of).digest()[:CHECKSUM_BYTES]
    body = zlib.compress(data) if compressed is None else compressed
    return base64.b64encode(MAGIC + bytes([version]) + digest + body).decode("ascii")


def bomb(size: int, level: int = 9) -> bytes:
    """A zlib stream of ``size`` zero bytes: about a thousandth of that on the wire."""
    inflater = zlib.compressobj(level)
    chunk = bytes(1 << 20)
    out = [inflater.compress(chunk) for _ in range(size >> 20)]
    return b"".join(out) + inflater.flush()


def refused(value: str, budget: ReasoningBudget | None = None) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        decode_reasoning(value, param=PARAM, budget=budget)
    assert caught.value.param == PARAM and caught.value.status_code == 400
    assert PARAM in caught.value.message
    return caught.value


# -- round trips -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "plain", "  The user wants files.\nI will list them.  ",
                                  "Ünïcode: 日本語, emoji 🤖, NUL \x00, surrogate-free ✓", "x" * 300_000])
def test_round_trip(text: str) -> None:
    value = encode_reasoning(text)
    assert value.startswith(PREFIX) and value.isascii() and len(value) % 4 == 0
    assert base64.b64decode(value, validate=True)  # plain standard base64, as Google's SDKs require
    assert decode_reasoning(value, param=PARAM) == text


def test_older_formats_still_decode() -> None:
    text = "Old reasoning, ünïcode ✓"
    data = text.encode("utf-8")
    anthropic_v1 = "rwt1." + base64.b64encode(zlib.compress(data)).decode("ascii")
    gemini_v1 = base64.b64encode(b"rw1" + zlib.compress(data)).decode("ascii")
    responses_v1 = ("rwr1." + base64.urlsafe_b64encode(data).decode("ascii") + "."
                    + hashlib.sha256(data).hexdigest()[:16])
    for value in (anthropic_v1, gemini_v1, responses_v1):
        assert decode_reasoning(value, param=PARAM) == text


def test_older_formats_are_bounded_too() -> None:
    big = bomb(64 << 20, level=zlib.Z_DEFAULT_COMPRESSION)  # the old writers' level: Gemini's is recognised by it
    refused("rwt1." + base64.b64encode(big).decode("ascii"))
    refused(base64.b64encode(b"rw1" + big).decode("ascii"))
    data = b"y" * (ITEM_LIMIT + 1)
    responses_v1 = ("rwr1." + base64.urlsafe_b64encode(data).decode("ascii") + "."
                    + hashlib.sha256(data).hexdigest()[:16])
    refused(responses_v1)


# -- foreign values ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    "",
    "EqQBCkgIARABGAIiQMR9kq2hGZfzbGp0",  # shaped like a real Anthropic signature
    "c29tZSByZWFsIGdlbWluaSBzaWduYXR1cmU=",  # a Gemini one: base64 of something else
    "gAAAAABo_encrypted_by_openai==",  # a Responses one from OpenAI's servers
    "not base64!",
    "ünïcode that is not ours",
])
def test_foreign_values_are_none(value: str) -> None:
    assert decode_reasoning(value, param=PARAM) is None


# -- damaged values of ours --------------------------------------------------------------------------------

def test_non_ascii_signature_is_a_bad_request() -> None:
    value = encode_reasoning("hello")
    assert "ASCII" in refused(value[:12] + "é" + value[13:]).message
    assert "ASCII" in refused("rwt1.abcdé").message


def test_not_utf8_with_a_valid_checksum_is_a_bad_request() -> None:
    assert "UTF-8" in refused(frame(b"\xff\xfe not text \xc3")).message
    data = b"\xff\xfe"
    responses_v1 = "rwr1." + base64.urlsafe_b64encode(data).decode() + "." + hashlib.sha256(data).hexdigest()[:16]
    assert "UTF-8" in refused(responses_v1).message


@pytest.mark.parametrize("value, why", [
    (encode_reasoning("some reasoning")[:-3], "base64"),  # trimmed: padding broken
    (PREFIX, "truncated"),
    (frame(b"text", checksum_of=b"other"), "checksum"),
    (frame(b"text", version=9), "version"),
    (frame(b"text", compressed=b"\x00not zlib at all"), "corrupt"),
    (frame(b"text" * 100, compressed=zlib.compress(b"text" * 100)[:-6]), "truncated"),
    (frame(b"text", compressed=zlib.compress(b"text") + b"junk"), "trailing"),
    ("rwt1.!!!!", "base64"),
    ("rwr1.AAAA.0000000000000000", "checksum"),
    ("rwr1.no-checksum", "checksum"),
])
def test_damaged_values_of_ours_are_bad_requests(value: str, why: str) -> None:
    assert why in refused(value).message


# -- bounded decoding --------------------------------------------------------------------------------------

def test_a_100_mb_bomb_is_refused_fast() -> None:
    value = frame(b"", compressed=bomb(100 << 20))
    assert len(value) < 200_000  # a small value ...
    started = time.perf_counter()
    error = refused(value)  # ... that would inflate to 100 MB
    assert time.perf_counter() - started < 0.5
    assert str(ITEM_LIMIT) in error.message


def test_a_272_kb_body_of_signatures_stays_within_the_request_budget() -> None:
    """Many values just under the per-item limit: together they must not inflate past the request's."""
    one = frame(bytes(ITEM_LIMIT - 1024), compressed=zlib.compress(bytes(ITEM_LIMIT - 1024), 9))
    count = 272_000 // len(one)
    assert count > REQUEST_LIMIT // ITEM_LIMIT  # enough of them to add up to more than the budget
    budget = ReasoningBudget()
    decoded = 0
    with pytest.raises(BadRequest) as caught:
        for _ in range(count):
            # the checksum is of the data, so each decodes fine until the budget runs out
            decode_reasoning(one, param=PARAM, budget=budget)
            decoded += 1
    assert "in all" in caught.value.message
    assert decoded * (ITEM_LIMIT - 1024) <= REQUEST_LIMIT


def test_budget_counts_across_values() -> None:
    budget = ReasoningBudget(remaining=10)
    assert decode_reasoning(encode_reasoning("12345"), param=PARAM, budget=budget) == "12345"
    assert budget.remaining == 5
    refused(encode_reasoning("123456"), budget)


def test_a_value_longer_than_any_of_ours_is_refused_before_decoding() -> None:
    assert "longer" in refused(PREFIX + "A" * (2 * ITEM_LIMIT)).message


# -- properties ----------------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.text())
def test_decode_inverts_encode(text: str) -> None:
    assert decode_reasoning(encode_reasoning(text), param=PARAM) == text


prefixes = st.sampled_from(["", PREFIX, "rwt1.", "rwr1.", "cncxeJ"])


@settings(max_examples=500, deadline=None)
@given(prefixes, st.text() | st.binary().map(lambda b: base64.b64encode(b).decode("ascii")))
def test_decode_of_anything_is_text_none_or_bad_request(prefix: str, rest: str) -> None:
    try:
        result = decode_reasoning(prefix + rest, param=PARAM, budget=ReasoningBudget())
    except BadRequest as exc:
        assert exc.param == PARAM
    else:
        assert result is None or isinstance(result, str)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1), st.integers(min_value=0), st.characters())
def test_damaging_a_value_of_ours_is_never_worse_than_a_bad_request(text: str, at: int, char: str) -> None:
    value = encode_reasoning(text)
    at = len(PREFIX) + at % max(1, len(value) - len(PREFIX))
    damaged = value[:at] + char + value[at + 1:]
    try:
        assert decode_reasoning(damaged, param=PARAM) in (None, text) or damaged == value
    except BadRequest:
        pass
