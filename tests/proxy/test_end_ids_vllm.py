"""End ids on an exactly continued call, on the real vLLM CPU server, for all four provider APIs.

The engine stops a turn on any of its end ids: the tokenizer's end of sequence (``<|im_end|>``, vLLM's
``stop_reason`` None), the generation config's other ones (``<|endoftext|>``, ``stop_reason`` the id), and
the request's ``stop_token_ids``. The bug: only the first was taken for an end on the exact path, so the
others were given to derender, which keeps special tokens for the tool parser, and the harness got
``done<|endoftext|>`` back (and echoed it into its history); the next call then added a close token the
model never sampled and marked the turn ``closed_cut_turn``.

Each case forces a first turn, then the answer followed by the end id itself (so every id is tried on
every run), then a third turn, and checks: the harness's text is the answer alone (its logprob entries
name the end id as an entry of its own, as vLLM's chat endpoint does, never as text), the event's sampled
ids end with the id, the next call continues from it with the template's glue only, and the session is
one trace. A stop *string* still cuts the text, and the turn it ends is closed by the template's token and
marked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deploy.engine.plugins import FORCED_TOKENS_ARG
from processors.builders import SessionFacts, build_trajectory
from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.harnesses.common import forced_turn, turn_token_ids
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

IM_END, END_OF_TEXT, BOX_END, NEWLINE = 151645, 151643, 151649, 198
# The tiny model's end ids, and how vLLM names each in a logprob entry. The third is not one of the
# model's: the session's request lists it in ``stop_token_ids``.
END_IDS = {"tokenizer_eos": IM_END, "generation_config": END_OF_TEXT, "request_stop_token_id": BOX_END}
END_NAMES = {IM_END: "<|im_end|>", END_OF_TEXT: "<|endoftext|>", BOX_END: "<|box_end|>"}
ANSWER = "done"
APIS = ("chat", "responses", "anthropic", "gemini")


@pytest.fixture
def real_proxy(kafka: KafkaSettings, vllm_url: str) -> Iterator[ProxyUnderTest]:
    with serve(create_app(proxy_settings(vllm_url, engine_timeout_s=300), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


def _text_ids(text: str) -> list[int]:
    """The ids of an assistant turn saying ``text``, without the ``<|im_end|>`` that closes it."""
    ids = turn_token_ids(text)
    assert ids[-1] == IM_END
    return ids[:-1]


def _sse(text: str) -> list[tuple[str | None, dict[str, Any]]]:
    """(event name, data) for each SSE frame with a JSON object."""
    frames, event = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: {"):
            frames.append((event, json.loads(line[6:])))
            event = None
    return frames


class Harness:
    """One provider API as a harness speaks it: sends the history, keeps what it got back."""

    def __init__(self, api: str, session: dict, stream: bool, stop: list[str] | None = None) -> None:
        self.api, self.session, self.stream, self.stop = api, session, stream, stop
        self.history: list[dict[str, Any]] = []
        self.stops: list[tuple[str | None, str | None]] = []  # Messages: each reply's stop_reason, stop_sequence

    def user(self, text: str) -> None:
        self.history.append({"role": "user", "parts": [{"text": text}]} if self.api == "gemini"
                            else {"role": "user", "content": text})

    def ask(self) -> tuple[str, list[str] | None]:
        """Post the history; the reply's text and its logprob entries' tokens (None where the API has none).
        The reply is appended to the history as the harness would send it back."""
        text, tokens, echo = getattr(self, f"_{self.api}")()
        self.history += echo
        return text, tokens

    def _post(self, url: str, body: dict[str, Any]) -> httpx.Response:
        response = httpx.post(url, json=body, headers=auth(self.session), timeout=300)
        assert response.status_code == 200, response.text
        return response

    def _chat(self) -> tuple[str, list[str], list[dict[str, Any]]]:
        body: dict[str, Any] = {"model": "m", "messages": self.history, "stream": self.stream, "logprobs": True}
        if self.stop:
            body["stop"] = self.stop
        response = self._post(f"{self.session['base_urls']['openai']}/chat/completions", body)
        if not self.stream:
            choice = response.json()["choices"][0]
            text = choice["message"]["content"]
            tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
        else:
            text, tokens = "", []
            for _, chunk in _sse(response.text):
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                    tokens += [entry["token"] for entry in (choice.get("logprobs") or {}).get("content") or ()]
        return text, tokens, [{"role": "assistant", "content": text}]

    def _responses(self) -> tuple[str, list[str], list[dict[str, Any]]]:
        body = {"model": "m", "input": self.history, "store": False, "stream": self.stream,
                "include": ["message.output_text.logprobs"]}
        response = self._post(f"{self.session['base_urls']['openai']}/responses", body)
        if not self.stream:
            [message] = [item for item in response.json()["output"] if item["type"] == "message"]
            part = message["content"][0]
            return part["text"], [entry["token"] for entry in part["logprobs"]], [message]
        text, tokens, final = "", [], None
        for event, data in _sse(response.text):
            if event == "response.output_text.delta":
                text += data["delta"]
                tokens += [entry["token"] for entry in data["logprobs"]]
            elif event == "response.completed":
                final = data["response"]
        assert final is not None, response.text
        [message] = [item for item in final["output"] if item["type"] == "message"]
        assert message["content"][0]["text"] == text
        return text, tokens, [message]

    def _anthropic(self) -> tuple[str, None, list[dict[str, Any]]]:
        body: dict[str, Any] = {"model": "m", "max_tokens": 16, "messages": self.history, "stream": self.stream}
        if self.stop:
            body["stop_sequences"] = self.stop
        response = self._post(f"{self.session['base_urls']['anthropic']}/v1/messages", body)
        if not self.stream:
            reply = response.json()
            text = "".join(block["text"] for block in reply["content"] if block["type"] == "text")
            self.stops.append((reply["stop_reason"], reply["stop_sequence"]))
        else:
            frames = list(_sse(response.text))
            text = "".join(data["delta"]["text"] for event, data in frames
                           if event == "content_block_delta" and data["delta"]["type"] == "text_delta")
            self.stops += [(data["delta"]["stop_reason"], data["delta"]["stop_sequence"])
                           for event, data in frames if event == "message_delta"]
        return text, None, [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    def _gemini(self) -> tuple[str, list[str], list[dict[str, Any]]]:
        config: dict[str, Any] = {"responseLogprobs": True}
        if self.stop:
            config["stopSequences"] = self.stop
        body = {"contents": self.history, "generationConfig": config}
        base = f"{self.session['base_urls']['gemini']}/v1beta/models/m"
        if not self.stream:
            candidates = [self._post(f"{base}:generateContent", body).json()["candidates"][0]]
        else:
            response = self._post(f"{base}:streamGenerateContent?alt=sse", body)
            candidates = [data["candidates"][0] for _, data in _sse(response.text) if data.get("candidates")]
        text = "".join(part.get("text", "") for c in candidates for part in (c.get("content") or {}).get("parts") or ())
        tokens = [chosen["token"] for c in candidates if "logprobsResult" in c
                  for chosen in c["logprobsResult"]["chosenCandidates"]]
        return text, tokens, [{"role": "model", "parts": [{"text": text}]}]


def _conversation(harness: Harness) -> list[tuple[str, list[str] | None]]:
    replies = []
    for turn in ("Start.", "Answer.", "Go on."):
        harness.user(turn)
        replies.append(harness.ask())
    return replies


def _prompt(event: Completion) -> list[int]:
    assert event.prompt_token_ids is not None
    return list(event.prompt_token_ids.tolist())


def _sampled(event: Completion) -> list[int]:
    assert event.token_ids is not None and event.logprobs is not None
    assert len(event.logprobs) == len(event.token_ids)  # each sampled id keeps its logprob
    return list(event.token_ids.tolist())


def _extends(child: Completion, parent: Completion) -> bool:
    whole = _prompt(parent) + _sampled(parent)
    return _prompt(child)[:len(whole)] == whole


def _one_trace(events: list[Completion]) -> Any:
    trajectory = build_trajectory("prefix_merging", events, SessionFacts(session_id=events[0].session_id))
    assert len(trajectory.traces) == 1, [t.sequences for t in trajectory.traces]
    [trace] = trajectory.traces
    assert trace.sequences == [e.sequence for e in events]
    return trace


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("end", END_IDS.values(), ids=list(END_IDS))
async def test_an_end_id_ends_the_turn_on_an_exact_continuation(real_proxy: ProxyUnderTest, api: str,
                                                                stream: bool, end: int) -> None:
    answer: dict[str, Any] = {"vllm_xargs": {FORCED_TOKENS_ARG: [*_text_ids(ANSWER), end]}}
    if end == BOX_END:
        answer["stop_token_ids"] = [BOX_END]
    session = real_proxy.new_session(engine={"continuation": "exact", "max_tokens": 16, "seed": 3,
                                             "turns": [forced_turn("Hi."), answer, forced_turn("Ok.")]})
    _, (text, tokens), _ = _conversation(Harness(api, session, stream))

    assert text == ANSWER
    first, second, third = await real_proxy.completions(3)
    assert second.continuation is not None and second.continuation.mode == "exact"
    assert _sampled(second) == [*_text_ids(ANSWER), end] and second.finish_reason == "stop"
    assert second.message is not None and second.message.content == ANSWER
    if tokens is not None:
        # One entry per sampled id, the end id's its own (named as vLLM's chat endpoint names it).
        assert tokens == [ANSWER, END_NAMES[end]]

    # The next call continues from the end id: the template's glue, no close token added.
    assert third.continuation is not None and third.continuation.mode == "exact"
    assert third.continuation.parent_sequence == second.sequence and not third.continuation.closed_cut_turn
    assert _extends(third, second) and _extends(second, first)
    closed_at = len(_prompt(second)) + len(_sampled(second))
    assert _prompt(third)[closed_at] == NEWLINE
    # A full re-render closes every turn with <|im_end|>: only the template differs from what was sampled.
    drift = third.continuation.drift
    assert drift is not None and drift.differs is (end != IM_END)
    assert drift.kinds == ([] if end == IM_END else ["template"])
    trace = _one_trace([first, second, third])
    end_at = closed_at - 1
    assert trace.token_ids.tolist()[end_at] == end and trace.loss_mask.tolist()[end_at] == 1
    assert trace.cut_turns == []


@pytest.mark.parametrize(("api", "stream"), [("chat", False), ("chat", True), ("anthropic", False),
                                             ("anthropic", True), ("gemini", True)])
async def test_a_stop_string_cuts_the_text_and_the_turn_is_closed_and_marked(real_proxy: ProxyUnderTest,
                                                                             api: str, stream: bool) -> None:
    forced = {"vllm_xargs": {FORCED_TOKENS_ARG: _text_ids("done. END here")}}
    session = real_proxy.new_session(engine={"continuation": "exact", "max_tokens": 16, "seed": 3,
                                             "turns": [forced_turn("Hi."), forced, forced_turn("Ok.")]})
    harness = Harness(api, session, stream, stop=["END"])
    _, (text, tokens), _ = _conversation(harness)

    assert text == "done. "  # as vLLM's chat endpoint cuts it: up to the stop string
    if api == "anthropic":  # Messages names the stop sequence; the other turns ended on the end of sequence
        assert harness.stops == [("end_turn", None), ("stop_sequence", "END"), ("end_turn", None)]
    first, second, third = await real_proxy.completions(3)
    assert second.continuation is not None and second.continuation.mode == "exact"
    assert _sampled(second) == _text_ids("done. END") and second.finish_reason == "stop"
    if tokens is not None:
        assert tokens == ["done", ".", " END"]  # every sampled id's entry, the stop string's token too
    # Closed by the template's token, which the model never sampled: the event says so.
    assert third.continuation is not None and third.continuation.mode == "exact"
    assert third.continuation.closed_cut_turn
    closed_at = len(_prompt(second)) + len(_sampled(second))
    assert _extends(third, second) and _prompt(third)[closed_at:closed_at + 2] == [IM_END, NEWLINE]
    _one_trace([first, second, third])
