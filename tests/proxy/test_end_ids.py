"""Which sampled end of a turn is an end id and which is text, without an engine or a broker.

vLLM stops on the tokenizer's end of sequence (``stop_reason`` None), on the generation config's other end
ids and the request's ``stop_token_ids`` (``stop_reason`` the id), and on stop strings (``stop_reason`` the
string). Only the first used to count as an end: a turn ending on ``<|endoftext|>`` was handed to
derender with that id, came back as ``done<|endoftext|>``, and was continued as a cut turn. The engine's
replies below are vLLM 0.32's on the tiny model (recorded from the CPU build), derender answering as it
does: every id it is given decoded into the text, special tokens kept.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from proxy.turns import EngineDelta, TurnAssembler, ends_on_end_id
from proxy.continuation.token_api import Generation, TokenApi, cut_at_stop_string
from schemas.completions import Usage

DONE, DOT, END_WORD, IM_END, END_OF_TEXT, BOX_END = 10438, 13, 11176, 151645, 151643, 151649
NAMES = {DONE: "done", DOT: ".", END_WORD: " END", IM_END: "<|im_end|>", END_OF_TEXT: "<|endoftext|>",
         BOX_END: "<|box_end|>"}


@pytest.mark.parametrize(("finish", "stop", "ids", "expected"), [
    ("stop", None, [DONE, IM_END], True),  # the tokenizer's end of sequence
    ("stop", END_OF_TEXT, [DONE, END_OF_TEXT], True),  # the generation config's other end id
    ("stop", BOX_END, [DONE, BOX_END], True),  # the request's stop_token_ids
    ("tool_calls", END_OF_TEXT, [DONE, END_OF_TEXT], True),
    ("stop", "END", [DONE, DOT, END_WORD], False),  # a stop string is text
    ("length", None, [DONE, DONE], False),
    ("stop", END_OF_TEXT, [DONE], False),  # an id that is not the last sampled one
    ("stop", None, [], False),
])
def test_which_ends_are_end_ids(finish: str, stop: int | str | None, ids: list[int], expected: bool) -> None:
    assert ends_on_end_id(finish, stop, ids) is expected


def test_a_streamed_turn_that_stops_on_a_stop_token_id_is_closed() -> None:
    """The chat endpoint's stream says the id in its last chunk; the branch must take the turn as closed."""
    assembler = TurnAssembler()
    assembler.add(EngineDelta(content="done", token_ids=[DONE], logprobs=[-0.1], prompt_token_ids=[1, 2]))
    assembler.add(EngineDelta(finish_reason="stop", stop_reason=END_OF_TEXT, token_ids=[END_OF_TEXT], logprobs=[-0.2]))
    turn = assembler.turn()
    assert turn.ends_on_end_id and turn.content == "done" and turn.token_ids == [DONE, END_OF_TEXT]


def _generation(ids: list[int], stop: int | str | None) -> Generation:
    entries = [{"token_id": i, "logprob": -0.5, "rank": 1, "top_logprobs": [{"token_id": i, "logprob": -0.5,
                                                                            "rank": 1}]} for i in ids]
    return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), logprob_entries=entries, finish_reason="stop",
                      stop_reason=stop, usage=Usage(prompt_tokens=2, completion_tokens=len(ids)))


@pytest.mark.parametrize("end", [IM_END, END_OF_TEXT, BOX_END])
def test_derender_is_not_given_the_end_id(end: int) -> None:
    generation = _generation([DONE, end], None if end == IM_END else end)
    [choice] = generation.response("m")["choices"]
    assert choice["token_ids"] == [DONE] and len(choice["logprobs"]["content"]) == 1


def _engine(asked: list[dict[str, Any]]) -> httpx.MockTransport:
    """derender and detokenize as vLLM answers them (every id derender is given is in its text)."""
    def reply(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append({"path": request.url.path, **body})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": "".join(NAMES[i] for i in body["tokens"])})
        choice = body["generate_response"]["choices"][0]
        text = "".join(NAMES[i] for i in choice["token_ids"])
        entries = [{"token": NAMES[e["token_id"]], "logprob": e["logprob"], "bytes": list(NAMES[e["token_id"]].encode()),
                    "top_logprobs": []} for e in choice["logprobs"]["content"]]
        return httpx.Response(200, json={"id": "chatcmpl-1", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": choice["finish_reason"],
            "logprobs": {"content": entries}}]})
    return httpx.MockTransport(reply)


@pytest.mark.parametrize("end", [IM_END, END_OF_TEXT, BOX_END])
async def test_an_end_id_is_kept_out_of_the_text_and_named_in_the_logprobs(end: int) -> None:
    asked: list[dict[str, Any]] = []
    async with httpx.AsyncClient(transport=_engine(asked), base_url="http://engine") as client:
        turn = await TokenApi(client).derender(_generation([DONE, end], None if end == IM_END else end),
                                               {"model": "m", "messages": []}, [1, 2], "m")
    assert turn.content == "done"
    assert turn.token_ids == [DONE, end] and turn.logprobs == [-0.5, -0.5] and turn.ends_on_end_id
    # As vLLM's chat endpoint gives them: one entry per sampled id, the end id's named as a token of its own.
    assert [entry["token"] for entry in turn.logprob_entries] == ["done", NAMES[end]]
    assert [a["generate_response"]["choices"][0]["token_ids"] for a in asked if "generate_response" in a] == [[DONE]]


async def test_a_stop_string_is_cut_from_the_text_and_the_turn_stays_open() -> None:
    asked: list[dict[str, Any]] = []
    async with httpx.AsyncClient(transport=_engine(asked), base_url="http://engine") as client:
        turn = await TokenApi(client).derender(_generation([DONE, DOT, END_WORD], "END"),
                                               {"model": "m", "messages": []}, [1, 2], "m")
    assert turn.content == "done. " and not turn.ends_on_end_id
    assert turn.token_ids == [DONE, DOT, END_WORD]
    assert [entry["token"] for entry in turn.logprob_entries] == ["done", ".", " END"]


def test_a_stop_string_in_the_reasoning_ends_the_text_there() -> None:
    turn = TurnAssembler().turn()
    turn.reasoning, turn.content = "think END more", "answer"
    cut_at_stop_string(turn, "END")
    assert (turn.reasoning, turn.content) == ("think ", None)
    turn.reasoning, turn.content = "think", "say END then"
    cut_at_stop_string(turn, "END")
    assert (turn.reasoning, turn.content) == ("think", "say ")
