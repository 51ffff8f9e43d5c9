"""The engine stream's reader: SSE lines split across socket reads come out whole, a read's
chunks come out as one batch, and a broken chunk stops the batch after the good ones before it.

The stream is vLLM's own, recorded (``tests/fixtures/vllm/chat_stream.json``), so a reader that drops,
doubles or garbles a chunk at some read boundary shows as a different turn.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from tests.support.standin_text import load_fixture
from proxy.calls import _check_turn
from proxy.engine import SseLines, _deltas
from proxy.turns import EngineDelta, TurnAssembler, read_token_ids
from schemas.arrays import TokenIds
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


def _first_chunk(**changes: object) -> dict:
    return {**RECORDED["chunks"][0], **changes}


def test_the_prompt_ids_come_as_text_and_read_into_the_same_ids() -> None:
    """The first chunk's prompt ids are cut out unread (the chunk goes out without waiting for them) and
    read when the turn needs them: the same ids, the same packed array, whatever the read size."""
    (first, *rest), error = _deltas(SseLines().feed(WIRE))
    assert error is None
    assert first.prompt_token_ids is None and first.prompt_ids_text is not None
    assert orjson.loads(first.prompt_ids_text) == RECORDED["chunks"][0]["prompt_token_ids"]
    assembler = TurnAssembler()
    assembler.add(first)
    assert assembler.prompt_pending
    assembler.settle_prompt()
    assert not assembler.prompt_pending
    assert assembler.prompt_token_ids == RECORDED["chunks"][0]["prompt_token_ids"]
    assert assembler.packed_prompt is not None and assembler.packed_prompt.tolist() == assembler.prompt_token_ids
    for delta in rest:
        assembler.add(delta)
    assembler.settle_prompt()  # already read: nothing changes
    turn = assembler.turn()
    assert turn.prompt_token_ids == RECORDED["chunks"][0]["prompt_token_ids"] and turn.prompt_error is None


def test_a_turn_taken_before_the_later_read_reads_the_prompt_ids_itself() -> None:
    (first, *rest), _ = _deltas(SseLines().feed(WIRE))
    assembler = TurnAssembler()
    for delta in (first, *rest):
        assembler.add(delta)
    turn = assembler.turn()  # nobody settled the prompt: the turn does
    assert turn.prompt_token_ids == RECORDED["chunks"][0]["prompt_token_ids"]
    assert turn.packed_prompt is not None and len(turn.packed_prompt) == len(turn.prompt_token_ids)


@pytest.mark.parametrize("payload", [
    # spaces after the colon (another server's JSON writer)
    lambda ids: b'{"object": "chat.completion.chunk", "choices": [], "prompt_token_ids": ' + ids + b"}",
    # the key at the end, compact
    lambda ids: b'{"choices":[],"prompt_token_ids":' + ids + b"}",
])
def test_prompt_ids_are_found_wherever_the_key_stands(payload) -> None:
    ids = [5, 0, 151644, 2147483647]
    deltas, error = _deltas([payload(orjson.dumps(ids))])
    assert error is None and deltas[0].prompt_ids_text is not None
    assembler = TurnAssembler()
    assembler.add(deltas[0])
    assert assembler.turn().prompt_token_ids == ids


def test_the_key_inside_text_or_nested_is_not_taken_for_the_chunks_prompt_ids() -> None:
    """The key's name in the reply's text, or a key of that name below the top level, leaves the chunk as
    it is (parsed whole): the text is intact and no prompt ids are made up."""
    text = 'say "prompt_token_ids":[1,2] please]'
    chunk = _first_chunk(choices=[{"index": 0, "delta": {"content": text}, "finish_reason": None,
                                   "nested": {"prompt_token_ids": [9, 9]}}])
    del chunk["prompt_token_ids"]
    deltas, error = _deltas([orjson.dumps(chunk)])
    assert error is None
    assert deltas[0].content == text
    assert deltas[0].prompt_ids_text is None and deltas[0].prompt_token_ids is None


def test_prompt_ids_that_are_not_plain_ids_still_fail_the_turn_clearly() -> None:
    """Ids that cannot be cut out as one array (a string with a bracket in it) are parsed with the chunk, as
    before; ids that cut out but are not JSON make the turn unusable with the reason, not a crash."""
    odd = b'{"choices":[],"prompt_token_ids":["a]",1]}'
    deltas, error = _deltas([odd])
    assert error is None and deltas[0].prompt_ids_text is None and deltas[0].prompt_token_ids == ["a]", 1]
    for ids in (b"[1,2,x]", b"[1,2.5]", b"[1,2,]", b"[,1]", b"[1,,2]", b"[3,-1]", b"[5000000000]", b"[1e3]"):
        deltas, error = _deltas([b'{"choices":[],"prompt_token_ids":' + ids + b"}"])
        assert error is None and deltas[0].prompt_ids_text == ids
        assembler = TurnAssembler()
        assembler.add(deltas[0])
        turn = assembler.turn()
        assert turn.prompt_error is not None and "not token ids" in turn.prompt_error, ids
        assert ids.decode() in turn.prompt_error and len(turn.prompt_token_ids) == 0
        with pytest.raises(EngineFailed, match="not token ids"):
            _check_turn(turn)  # what the call checks before it serves or records a turn


@pytest.mark.parametrize("ids", [[], [0], [2147483647], list(range(0, 300000, 7))])
def test_prompt_ids_read_from_text_are_the_engines_ids(ids: list[int]) -> None:
    for text in (orjson.dumps(ids), orjson.dumps(ids).replace(b",", b", \n")):
        read = read_token_ids(text)
        assert isinstance(read, TokenIds) and read.tolist() == ids and read.numpy.dtype == np.int32


@pytest.mark.parametrize("ids", [[], [7], [1, 2, 3], list(range(1000))])
def test_a_chunk_counts_its_prompt_ids_before_reading_them(ids: list[int]) -> None:
    deltas, _ = _deltas([b'{"choices":[],"prompt_token_ids": ' + orjson.dumps(ids).replace(b",", b", ") + b"}"])
    assert deltas[0].prompt_ids_text is not None and deltas[0].prompt_length == len(ids)
    assert EngineDelta(prompt_token_ids=ids).prompt_length == len(ids) and EngineDelta().prompt_length == 0
