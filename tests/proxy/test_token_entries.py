"""Sampled tokens' entries in each API's shape (proxy/apis/token_entries.py), from what an engine may give:
the chat endpoint's named entries, the token endpoints' id-only ones, entries with no alternatives or bytes,
and none at all (values only)."""

from __future__ import annotations

import pytest

from proxy.errors import BadRequest
from proxy.apis.token_entries import average, checked_top_logprobs, gemini_logprobs, openai_entries, stream_entries

VALUES = [-1.0, -2.0, -0.5]
NAMED = {"token": "c", "logprob": -0.5, "bytes": [99], "top_logprobs": [{"token": "c", "logprob": -0.5, "bytes": [99]},
                                                                          {"token": "d", "logprob": -3.0, "bytes": [100]}]}
ENTRIES = [{"token": "é", "logprob": -1.0, "bytes": None, "top_logprobs": None},
           {"token_id": 5, "logprob": -2.0, "top_logprobs": [{"token_id": 7, "logprob": -2.5}]},
           NAMED]


def test_responses_entries_always_list_bytes_and_alternatives() -> None:
    out = openai_entries(VALUES, ENTRIES, bytes_always=True)
    assert [e["token"] for e in out] == ["é", "token_id:5", "c"]
    assert out[0]["bytes"] == list("é".encode()) and out[0]["top_logprobs"] == []
    assert out[1]["top_logprobs"] == [{"token": "token_id:7", "logprob": -2.5, "bytes": list(b"token_id:7")}]
    assert out[2] is NAMED  # already whole: passed as the engine gave it
    assert [e["logprob"] for e in out] == VALUES
    streamed = stream_entries(out)
    assert streamed[2] == {"token": "c", "logprob": -0.5, "top_logprobs": [{"token": "c", "logprob": -0.5},
                                                                           {"token": "d", "logprob": -3.0}]}
    assert all("bytes" not in e for e in streamed)


def test_without_an_entry_per_token_only_the_values_are_told() -> None:
    assert openai_entries(VALUES, ENTRIES[:2]) == [{"token": "", "logprob": v, "bytes": None, "top_logprobs": []}
                                                   for v in VALUES]
    result = gemini_logprobs(VALUES, [], [11, 12, 13])
    assert [c["tokenId"] for c in result["chosenCandidates"]] == [11, 12, 13]
    assert [c["logProbability"] for c in result["chosenCandidates"]] == VALUES


def test_gemini_names_the_chosen_token_and_its_alternatives() -> None:
    result = gemini_logprobs(VALUES, ENTRIES, [1, 5, 3])
    assert result["chosenCandidates"][1] == {"token": "token_id:5", "logProbability": -2.0, "tokenId": 5}
    assert result["topCandidates"][2]["candidates"] == [{"token": "c", "logProbability": -0.5},
                                                        {"token": "d", "logProbability": -3.0}]
    assert average([-1.0, None, -2.0]) == -1.5 and average([None]) is None


@pytest.mark.parametrize("value", [-1, 21])
def test_top_logprobs_out_of_range_is_refused_naming_the_field(value: int) -> None:
    with pytest.raises(BadRequest) as caught:
        checked_top_logprobs(value, "generationConfig.logprobs")
    assert caught.value.param == "generationConfig.logprobs"
    assert checked_top_logprobs(None, "x") == 0 and checked_top_logprobs(20, "x") == 20
