"""The proxy writes prompt deltas: through the real proxy, the stand-in engine's token endpoints and Kafka.

Each exactly continued call's event is a delta against its branch's previous event; read back from the
broker and resolved, every prompt is the one the engine was sent (the ids the proxy posted to generate,
or the chat endpoint's own prompt ids for a branch's first call). Keyframes come on a branch's first
call, every K calls, for failed calls, and after the branch was evicted; no delta ever names an event
that is not on the log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

import proxy.continuation.branches
import proxy.calls
from tests.support.standin_engine import StandinConfig, create_app as create_standin
from proxy.app import create_app
from schemas.codec import encode_event
from schemas.completions import Completion
from schemas.prompt_chain import is_delta, resolve_session
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command. " * 30,
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}}}}}]


class EngineLog:
    """The stand-in engine behind an ASGI wrapper that keeps the token ids of every generate request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.generated: list[list[int]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/inference/v1/generate":
            await self.app(scope, receive, send)
            return
        messages, body, more = [], b"", True
        while more:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.generated.append(list(orjson.loads(body)["token_ids"]))

        async def replay() -> dict:
            return messages.pop(0) if messages else {"type": "http.disconnect"}
        await self.app(scope, replay, send)


@pytest.fixture(autouse=True)
def no_growth_keyframes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in's prompts are a few hundred bytes, so they outgrow their keyframe within a few turns;
    these tests count keyframes by K (growth has its own test)."""
    monkeypatch.setattr(proxy.calls, "KEYFRAME_GROWTH", float("inf"))


@pytest.fixture
def engine_log() -> EngineLog:
    return EngineLog(create_standin(StandinConfig(latency_ms=1, reply_tokens=12, token_api=True)))


@pytest.fixture
def delta_proxy(kafka: KafkaSettings, engine_log: EngineLog) -> Iterator[ProxyUnderTest]:
    with serve(engine_log) as engine_url, serve(create_app(proxy_settings(engine_url), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


def ask(session: dict, messages: list[dict], *, stream: bool = False, tools: list | None = TOOLS) -> dict:
    """One chat call; the assistant message to append to the history."""
    body: dict[str, Any] = {"model": "m", "messages": messages, "stream": stream}
    if tools is not None:
        body["tools"] = tools
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session), timeout=30,
                          json=body)
    assert response.status_code == 200, response.text
    if not stream:
        message = response.json()["choices"][0]["message"]
        return {"role": "assistant", "content": message.get("content") or "",
                **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})}
    chunks = [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return {"role": "assistant",
            "content": "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])}


def converse(session: dict, turns: int, *, first: list[dict] | None = None) -> list[dict]:
    history = first or [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "go"}]
    for turn in range(turns):
        reply = ask(session, history, stream=turn % 2 == 1)
        history = [*history, reply, {"role": "user", "content": f"next {turn}"}]
    return history


def of_session(events: list[Completion], session: dict) -> list[Completion]:
    return sorted((e for e in events if e.session_id == session["session_id"]), key=lambda e: e.sequence)


async def test_continued_calls_are_deltas_that_resolve_to_what_the_engine_was_sent(
        delta_proxy: ProxyUnderTest, engine_log: EngineLog) -> None:
    session = delta_proxy.new_session(engine={"max_tokens": 12})
    history = converse(session, 6)
    raw = of_session(await delta_proxy.completions(6, raw=True), session)
    assert [is_delta(e) for e in raw] == [False] + [True] * 5
    assert raw[0].continuation.mode == "rendered" and raw[0].continuation.opened == "first_call"  # type: ignore[union-attr]
    for parent, child in zip(raw, raw[1:]):
        delta = child.prompt_delta
        assert delta is not None and child.continuation.mode == "exact"  # type: ignore[union-attr]
        assert (delta.parent_event_id, delta.parent_sequence) == (parent.event_id, parent.sequence)
        assert delta.tools_inherited and child.request.tools == []
        assert [m.role for m in child.request.messages] == ["assistant", "user"]  # only what is new
        # The shared prefix is the parent's whole prompt + sampled ids; the delta carries the rest.
        assert delta.prefix_tokens == child.continuation.prefix_tokens  # type: ignore[union-attr]
        assert len(child.prompt_token_ids) == child.continuation.new_tokens  # type: ignore[union-attr,arg-type]
    chain = resolve_session(raw)
    assert chain.missing == []
    resolved = chain.resolved
    # The exact calls' prompts are the ids the proxy posted to the engine's generate endpoint, in order.
    assert [e.prompt_token_ids.tolist() for e in resolved[1:]] == engine_log.generated  # type: ignore[union-attr]
    for parent, child in zip(resolved, resolved[1:]):
        head = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()  # type: ignore[union-attr]
        assert child.prompt_token_ids.tolist()[:len(head)] == head  # type: ignore[union-attr]
        assert child.continuation.prefix_tokens == len(head)  # type: ignore[union-attr]
    assert len(resolved[-1].request.messages) == len(history) - 2  # all but its own reply and the next user turn
    assert [t.name for t in resolved[-1].request.tools] == ["shell"]
    assert resolved == of_session(await delta_proxy.completions(6), session)  # the tests' own reader agrees


async def test_a_keyframe_every_k_calls(delta_proxy: ProxyUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.calls, "KEYFRAME_EVERY", 3)
    session = delta_proxy.new_session(engine={"max_tokens": 12})
    converse(session, 7)
    raw = of_session(await delta_proxy.completions(7, raw=True), session)
    assert [is_delta(e) for e in raw] == [False, True, True, False, True, True, False]
    assert raw[4].prompt_delta.parent_event_id == raw[3].event_id  # type: ignore[union-attr]
    assert resolve_session(raw).missing == []


async def test_a_keyframe_when_the_prompt_outgrows_its_keyframe(delta_proxy: ProxyUnderTest,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.calls, "KEYFRAME_GROWTH", 1.1)
    session = delta_proxy.new_session(engine={"max_tokens": 12})
    converse(session, 8)
    raw = of_session(await delta_proxy.completions(8, raw=True), session)
    keyframe_tokens = 0
    for event in raw:
        if event.prompt_delta is None:
            keyframe_tokens = len(event.prompt_token_ids) + len(event.token_ids)  # type: ignore[arg-type]
        else:
            assert event.prompt_delta.prompt_tokens <= 1.1 * keyframe_tokens
    assert sum(not is_delta(e) for e in raw) >= 2 and sum(map(is_delta, raw)) >= 2
    assert resolve_session(raw).missing == []


async def test_failed_calls_are_keyframes_and_never_parents(kafka: KafkaSettings, engine_log: EngineLog) -> None:
    with serve(engine_log) as engine_url, serve(create_app(proxy_settings(engine_url), kafka)) as url:
        under_test = ProxyUnderTest(url, kafka)
        # The engine fails the call whose prompt holds three assistant turns.
        session = under_test.new_session(engine={"max_tokens": 12, "turns": [{}, {}, {}, {"standin_fail": "error"}]})
        history = converse(session, 2)
        refused = httpx.post(f"{session['base_urls']['openai']}/chat/completions", timeout=30,
                             headers={**auth(session), "content-type": "application/json"}, content=b"{not json")
        assert refused.status_code == 400
        reply = ask(session, history)
        history = [*history, reply, {"role": "user", "content": "and now?"}]
        failed = httpx.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session), timeout=30,
                            json={"model": "m", "messages": history, "tools": TOOLS})
        assert failed.status_code >= 500
        raw = of_session(await under_test.completions(5, raw=True), session)
    assert [e.status for e in raw] == ["ok", "ok", "error", "ok", "error"]
    assert [is_delta(e) for e in raw] == [False, True, False, True, False]
    # The call after the refused one is a delta against the last served call, not the failed one.
    assert raw[3].prompt_delta.parent_event_id == raw[1].event_id  # type: ignore[union-attr]
    failed_ids = {e.event_id for e in raw if e.status == "error"}
    assert not {e.prompt_delta.parent_event_id for e in raw if e.prompt_delta} & failed_ids
    chain = resolve_session(raw)
    assert chain.missing == []
    assert chain.resolved[4].prompt_token_ids is None or \
        len(chain.resolved[4].prompt_token_ids) > len(chain.resolved[3].prompt_token_ids)  # type: ignore[arg-type]


async def test_an_evicted_branch_continues_with_a_keyframe(delta_proxy: ProxyUnderTest,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.continuation.branches, "MAX_BRANCHES", 1)
    session = delta_proxy.new_session(engine={"max_tokens": 12})
    history = converse(session, 2)
    ask(session, [{"role": "user", "content": "a title for this chat"}], tools=None)  # a side call: evicts main
    ask(session, history)
    raw = of_session(await delta_proxy.completions(4, raw=True), session)
    assert [is_delta(e) for e in raw] == [False, True, False, False]
    assert raw[3].continuation.opened is not None  # type: ignore[union-attr]  # the main line reopened
    assert resolve_session(raw).missing == []


def test_a_slimmed_delta_keeps_its_tokens_and_takes_no_request_from_its_parent() -> None:
    """A delta too large to record is written slimmed (request dropped): it still resolves to its full
    prompt, with no messages and no tools, like a slimmed keyframe."""
    from proxy.capture import slimmed
    from proxy.errors import UnrecordableEvent
    from schemas.prompt_chain import write_session
    from tests.support.generated_sessions import generated_session

    full = generated_session(11, ["continue"])
    parent, child = write_session(full)
    slim = slimmed(child, UnrecordableEvent("the call is too large to record"))
    assert slim.status == "error" and is_delta(slim) and slim.request.messages == []
    assert slim.prompt_delta.messages_prefix == 0 and not slim.prompt_delta.tools_inherited  # type: ignore[union-attr]
    [_, resolved] = resolve_session([parent, slim]).resolved
    assert resolved.prompt_token_ids == full[1].prompt_token_ids
    assert resolved.request.messages == [] and resolved.request.tools == []


async def test_a_keyframe_over_the_record_limit_is_written_as_a_delta(kafka: KafkaSettings,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A long session's periodic keyframe can pass the record limit (a 1M-token context) while its delta,
    the new turn alone, is small: the call is written as a delta and stays a served call, rather than a
    slimmed failed one. Only a call that cannot be written either way is slimmed."""
    monkeypatch.setattr(proxy.calls, "KEYFRAME_EVERY", 2)  # the second call is due a keyframe
    limit = 1024 * 1024
    small = kafka.model_copy(update={"max_message_bytes": limit})
    engine = create_standin(StandinConfig(latency_ms=1, reply_tokens=12, token_api=True, max_model_len=1_000_000))
    with serve(engine) as engine_url, serve(create_app(proxy_settings(engine_url), small)) as url:
        under_test = ProxyUnderTest(url, small)
        session = under_test.new_session(engine={"max_tokens": 12})
        # How many event bytes a byte of prompt text costs here (its text and its token ids).
        probe = [{"role": "user", "content": "x" * 50_000}]
        ask(session, probe, tools=None)
        (first,) = of_session(await under_test.completions(1, raw=True), session)
        per_byte = len(encode_event(first)) / 50_000
        # Then a history of about 0.3 of the limit, and a turn that brings it to about 1.1.
        history = [{"role": "user", "content": "y" * int(0.3 * limit / per_byte)}]
        history += [ask(session, history, tools=None), {"role": "user", "content": "z" * int(0.8 * limit / per_byte)}]
        ask(session, history, tools=None)
        # A last turn that alone is over the limit (its text and ids), though its ids alone are not: the
        # call is refused in the harness's protocol, and recorded slimmed as a delta (its ids, no text).
        history += [ask(session, history, tools=None), {"role": "user", "content": "w" * int(1.1 * limit / per_byte)}]
        refused = httpx.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                             timeout=30, json={"model": "m", "messages": history})
        assert refused.status_code == 413 and "too large to record" in refused.json()["error"]["message"]
        raw = of_session(await under_test.completions(5, raw=True), session)
    probe_call, opening, grown, after, too_big = raw
    assert [e.status for e in raw] == ["ok", "ok", "ok", "ok", "error"]
    assert not is_delta(opening) and is_delta(grown)  # due a keyframe (K=2), written as a delta
    assert grown.prompt_delta.parent_event_id == opening.event_id  # type: ignore[union-attr]
    full = resolve_session(raw).resolved[2]
    assert len(encode_event(full)) > limit >= len(encode_event(grown))  # the keyframe would not have fitted
    assert is_delta(after)  # its chain goes on past K: the next keyframe would not fit either
    assert too_big.request.messages == [] and too_big.error is not None and is_delta(too_big)
    assert too_big.prompt_delta.parent_event_id == after.event_id  # type: ignore[union-attr]
    chain = resolve_session(raw)
    assert chain.missing == []
    assert chain.resolved[4].prompt_token_ids.tolist()[:len(chain.resolved[3].prompt_token_ids)] == \
        chain.resolved[3].prompt_token_ids.tolist()  # type: ignore[union-attr]  # its whole prompt, resolved
