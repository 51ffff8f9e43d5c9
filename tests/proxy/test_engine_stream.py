"""The engine stream's reader: SSE lines split across socket reads come out whole, a read's
chunks come out as one batch, and a broken chunk stops the batch after the good ones before it.

The stream is vLLM's own, recorded (``tests/fixtures/vllm/chat_stream.json``), so a reader that drops,
doubles or garbles a chunk at some read boundary shows as a different turn.
"""

from __future__ import annotations

import orjson
import pytest

from tests.support.standin_text import load_fixture
from proxy.engine import SseLines, _deltas
from proxy.turns import EngineDelta, TurnAssembler
from proxy.errors import EngineFailed

RECORDED = load_fixture("chat_stream.json")
WIRE = b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in RECORDED["chunks"]) + b"data: [DONE]\n\n"


def read_in_pieces(wire: bytes, size: int) -> list[list[EngineDelta]]:
    lines = SseLines()
    batches = []
    for start in range(0, len(wire), size):
        deltas, error = _deltas(lines.feed(wire[start:start + size]))
        assert error is None
        batches.append(deltas)
    deltas, error = _deltas(lines.close())
    assert error is None
    return [*batches, deltas]


def turn_of(batches: list[list[EngineDelta]]) -> tuple:
    assembler = TurnAssembler()
    for batch in batches:
        for delta in batch:
            assembler.add(delta)
    turn = assembler.turn()
    return turn.prompt_token_ids, turn.token_ids, turn.logprobs, turn.content, turn.finish_reason


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1000, len(WIRE)])
def test_reads_of_any_size_give_the_same_turn(size: int) -> None:
    whole = read_in_pieces(WIRE, len(WIRE))
    assert len(whole[0]) == len(RECORDED["chunks"])  # one read: every chunk in one batch
    assert turn_of(read_in_pieces(WIRE, size)) == turn_of(whole)
    assert turn_of(whole)[1]  # the recorded stream has sampled tokens


def test_crlf_lines_and_a_last_line_without_newline_are_read() -> None:
    wire = WIRE.replace(b"\n", b"\r\n").removesuffix(b"data: [DONE]\r\n\r\n")
    last = wire.rstrip(b"\r\n")  # the stream ends right after its last chunk, no newline
    batches = read_in_pieces(last, 5)
    assert sum(len(b) for b in batches) == len(RECORDED["chunks"])


def test_a_broken_chunk_keeps_the_good_ones_before_it() -> None:
    first, second = (b"data: " + orjson.dumps(c) + b"\n\n" for c in RECORDED["chunks"][:2])
    for broken, reason in ((b"data: {not json\n\n", "not JSON"), (b"data: [1, 2]\n\n", "not a JSON object"),
                           (b'data: {"error": {"message": "boom"}}\n\n', "boom")):
        deltas, error = _deltas(SseLines().feed(first + second + broken + first))
        assert len(deltas) == 2
        assert isinstance(error, EngineFailed) and reason in error.message
