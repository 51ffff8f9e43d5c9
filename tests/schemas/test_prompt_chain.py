"""Prompt deltas: any session written as deltas resolves to its full events; broken chains are reported.

In memory: a property test over session shapes (branches, continuations, retries, failed calls, changed
tools) and keyframe intervals; v1 and v2 events mixed; every kind of broken chain. Through the real
broker: the recorded real-CLI sessions and a generated 50-turn session written as deltas, read back and
resolved; a child whose parent is not on the log dead-lettered with the reason by a consumer that
resolves as it reads.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.merge import recorded_by_cli
from processors.builders import SessionFacts, build_trajectory
from processors.builders.common import UnresolvedPromptDelta
from schemas.arrays import TokenIds
from schemas.codec import EventDecodeError, decode_event, encode_event
from schemas.completions import (
    ChatMessage,
    Completion,
    NormalizedRequest,
)
from schemas.dead_letter import DeadLetter
from schemas.prompt_chain import (
    ChainLink,
    MissingPromptParent,
    PromptChains,
    delta_against,
    is_delta,
    resolve_session,
    write_session,
)
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from tests.support.generated_sessions import OTHER_TOOLS, generated_session, random_ids

SESSIONS_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"
RECORDED = [events for sessions in recorded_by_cli(SESSIONS_DIR).values() for events in sessions]


# -- generated sessions ------------------------------------------------------------------------------------

STEPS = st.lists(st.sampled_from(["continue", "continue", "continue", "open", "retry", "fail", "tools", "switch"]),
                 max_size=30)


def assert_same(resolved: list[Completion], full: list[Completion]) -> None:
    assert len(resolved) == len(full)
    for got, want in zip(resolved, full):
        assert got.event_id == want.event_id and not is_delta(got)
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.request == want.request
        # Equal whole, but for the writer's stamp (a producer sets emitted_at and source).
        assert got.model_copy(update={"emitted_at": want.emitted_at, "source": want.source}) == want


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), steps=STEPS, keyframe_every=st.integers(1, 12),
       growth=st.sampled_from([1.5, 4.0, float("inf")]))
def test_any_session_resolves_to_its_full_events(seed: int, steps: list[str], keyframe_every: int,
                                                 growth: float) -> None:
    full = generated_session(seed, steps)
    written = list(write_session(full, keyframe_every=keyframe_every, keyframe_growth=growth))
    # Through the codec, as a consumer reads them.
    decoded = [decode_event(encode_event(e)) for e in written]
    assert all(isinstance(e, Completion) for e in decoded)
    chain = resolve_session(decoded)  # type: ignore[arg-type]
    assert chain.missing == []
    assert_same(chain.resolved, full)
    # Any order in, input order out.
    shuffled = list(reversed(decoded))
    assert_same(resolve_session(shuffled).resolved, list(reversed(full)))  # type: ignore[arg-type]
    # Streaming, in log order.
    chains = PromptChains()
    assert_same([chains.resolve(e) for e in decoded], full)  # type: ignore[arg-type]
    # What is written: failed calls and branch openings are keyframes; chains are at most K long, and no
    # delta's prompt is over ``growth`` times its chain keyframe's tokens.
    depth: dict[str, int] = {}
    keyframe: dict[str, int] = {}
    for event, whole in zip(written, full):
        if event.status != "ok" or event.continuation.mode == "rendered":  # type: ignore[union-attr]
            assert not is_delta(event)
        delta = event.prompt_delta
        depth[event.event_id] = 0 if delta is None else depth[delta.parent_event_id] + 1
        keyframe[event.event_id] = len(whole.prompt_token_ids or ()) + len(whole.token_ids or ()) \
            if delta is None else keyframe[delta.parent_event_id]
        assert depth[event.event_id] < keyframe_every
        assert delta is None or delta.prompt_tokens <= growth * keyframe[event.event_id]
        if delta is not None:
            parent = next(e for e in full if e.event_id == delta.parent_event_id)
            assert parent.status == "ok" and parent.continuation.branch == event.continuation.branch  # type: ignore[union-attr]
    if growth == float("inf") and steps.count("continue") and \
            not {"tools", "switch", "open", "fail", "retry"} & set(steps):
        assert sum(map(is_delta, written)) == sum(1 for i in range(len(written)) if i % keyframe_every)


def test_a_continuation_carries_only_what_is_new_and_inherits_its_tools() -> None:
    first, second, third = generated_session(1, ["continue", "continue"])
    written = list(write_session([first, second, third]))
    assert [is_delta(e) for e in written] == [False, True, True]
    delta = written[2].prompt_delta
    assert delta is not None and delta.parent_event_id == second.event_id and delta.parent_sequence == 1
    assert delta.prefix_tokens == len(second.prompt_token_ids) + len(second.token_ids)  # type: ignore[arg-type]
    assert len(written[2].prompt_token_ids) == len(third.prompt_token_ids) - delta.prefix_tokens  # type: ignore[arg-type]
    assert delta.messages_prefix == len(second.request.messages)
    assert [m.role for m in written[2].request.messages] == ["assistant", "tool"]
    assert delta.tools_inherited and written[2].request.tools == []
    assert written[2].schema_version == 2 and len(encode_event(written[2])) < len(encode_event(third)) / 2


def test_changed_tools_are_written_whole() -> None:
    events = generated_session(2, ["continue", "tools", "continue"])
    written = list(write_session(events))
    assert is_delta(written[2]) and not written[2].prompt_delta.tools_inherited  # type: ignore[union-attr]
    assert written[2].request.tools == OTHER_TOOLS
    assert resolve_session(written).resolved[2].request.tools == OTHER_TOOLS


def test_a_delta_that_would_not_be_smaller_is_a_keyframe() -> None:
    full = generated_session(3, ["continue"])
    parent = ChainLink.of(full[0])
    unrelated = full[1].model_copy(update={
        "prompt_token_ids": TokenIds(random_ids(np.random.default_rng(9), 300)),
        "request": NormalizedRequest(messages=[ChatMessage(role="user", content="x")], tools=OTHER_TOOLS)})
    assert delta_against(unrelated, parent) is unrelated


# -- versions ----------------------------------------------------------------------------------------------

def test_v1_events_still_decode_and_resolve_to_themselves() -> None:
    line = (SESSIONS_DIR / "qwen-code-1.jsonl").read_text(encoding="utf-8").splitlines()[0]
    assert '"schema_version":1' in line
    event = decode_event(line.encode())
    assert isinstance(event, Completion) and event.schema_version == 1 and not is_delta(event)
    assert resolve_session([event]).resolved == [event]
    assert PromptChains().resolve(event) is event


def test_unknown_versions_and_v1_deltas_are_refused() -> None:
    delta = list(write_session(generated_session(4, ["continue"])))[1]
    document = encode_event(delta).decode()
    with pytest.raises(EventDecodeError) as refused:
        decode_event(document.replace('"schema_version":2', '"schema_version":3').encode())
    assert refused.value.error_type == "unsupported_schema_version"
    with pytest.raises(EventDecodeError) as invalid:
        decode_event(document.replace('"schema_version":2', '"schema_version":1').encode())
    assert invalid.value.error_type == "invalid_event" and "schema_version 2" in invalid.value.reason


@pytest.mark.parametrize("builder", ["per_request", "prefix_merging"])
def test_a_log_of_v1_and_v2_events_builds_the_same_trajectories(builder: str) -> None:
    """The recorded (v1) sessions as they are, and the same sessions written as v2 deltas, in one replay."""
    for events in RECORDED:
        facts = SessionFacts(session_id=events[0].session_id)
        as_v1 = build_trajectory(builder, events, facts)
        written = list(write_session(events))
        assert any(is_delta(e) for e in written) and all(e.schema_version == 1 for e in written if not is_delta(e))
        mixed = [*written[::2], *events[1::2]]  # every other event as the v2 delta, the rest as recorded
        for replay in (written, mixed):
            chain = resolve_session(replay)
            assert chain.missing == []
            rebuilt = build_trajectory(builder, chain.resolved, facts)
            assert rebuilt.event_id == as_v1.event_id
            assert [t.model_dump(mode="json") for t in rebuilt.traces] == \
                [t.model_dump(mode="json") for t in as_v1.traces]


def test_builders_refuse_an_unresolved_delta() -> None:
    written = list(write_session(generated_session(5, ["continue"])))
    with pytest.raises(UnresolvedPromptDelta, match="resolve_session"):
        build_trajectory("prefix_merging", written, SessionFacts(session_id="s-gen"))


# -- broken chains -----------------------------------------------------------------------------------------

def test_a_missing_parent_and_its_descendants_are_reported() -> None:
    full = generated_session(6, ["continue"] * 4)
    written = list(write_session(full))
    lost = written[2]
    chain = resolve_session([e for e in written if e is not lost])
    assert [e.sequence for e in chain.resolved] == [0, 1]
    assert [m.completion.sequence for m in chain.missing] == [3, 4]
    assert f"parent {lost.event_id} (sequence 2) is not among the session's completions" == chain.missing[0].reason
    assert chain.missing[1].reason.startswith(f"parent {written[3].event_id} (sequence 3) cannot be resolved: "
                                              f"parent {lost.event_id}")

    chains = PromptChains()
    assert chains.resolve(written[0]).sequence == 0
    with pytest.raises(MissingPromptParent, match="was not read before it"):
        chains.resolve(written[2])  # its parent (1) was never read
    with pytest.raises(MissingPromptParent, match="cannot be resolved"):
        chains.resolve(written[3])
    assert chains.missing == 2


def test_a_corrupted_reference_is_reported_not_resolved() -> None:
    full = generated_session(7, ["continue", "continue"])
    written = list(write_session(full))
    child = written[2]
    assert child.prompt_delta is not None
    wrong_sequence = child.model_copy(update={"prompt_delta": child.prompt_delta.model_copy(
        update={"parent_sequence": 0})})
    [missing] = resolve_session([*written[:2], wrong_sequence]).missing
    assert "sequence" in missing.reason and "corrupted" in missing.reason
    too_long = child.model_copy(update={"prompt_delta": child.prompt_delta.model_copy(
        update={"prefix_tokens": 10**6, "prompt_tokens": 10**6 + len(child.prompt_token_ids)})})  # type: ignore[arg-type]
    [missing] = resolve_session([*written[:2], too_long]).missing
    assert "takes 1000000 tokens" in missing.reason
    other_session = full[1].model_copy(update={"session_id": "another"})
    [missing] = resolve_session([written[0], other_session, child]).missing
    assert "never crosses sessions" in missing.reason


def test_the_streaming_cache_is_bounded() -> None:
    chains = PromptChains(max_bytes=20_000)
    sessions = [list(write_session(generated_session(s, ["continue"] * 3, session_id=f"s{s}"))) for s in range(20)]
    for written in sessions:
        for event in written:
            chains.resolve(event)
    assert chains.bytes <= 20_000 + max(ChainLink.of(e).approx_bytes for w in sessions for e in w)
    with pytest.raises(MissingPromptParent, match="cache of 20000 bytes"):
        chains.resolve(sessions[0][3])


# -- through the real broker -------------------------------------------------------------------------------

async def _produce(kafka: KafkaSettings, events: list[Completion]) -> None:
    async with EventProducer(kafka, service="test") as producer:
        for event in events:  # one send at a time, as the proxy does
            await producer.send(event)


async def _read_resolved(kafka: KafkaSettings, want: int, *, dead_letters: bool = False,
                         timeout_s: float = 60) -> tuple[list[Completion], list[str]]:
    """Read the completions topic from the start, resolving as a consumer does; a child whose parent is not
    there is dead-lettered (``dead_letters``) with the reason."""
    resolved: list[Completion] = []
    refused: list[str] = []
    chains = PromptChains()
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None if not dead_letters else "resolver",
                             dead_letters=dead_letters, service="resolver") as consumer:
        async def loop() -> None:
            while len(resolved) + len(refused) < want:
                for record in await consumer.getmany_raw(timeout_ms=300):
                    received = await consumer.take(record)
                    if received is None:
                        continue
                    assert isinstance(received.event, Completion)
                    try:
                        resolved.append(chains.resolve(received.event))
                    except MissingPromptParent as exc:
                        refused.append(received.event.event_id)
                        await consumer.dead_letter(record, exc.error_type, exc.reason)
        await asyncio.wait_for(loop(), timeout_s)
    return resolved, refused


@pytest.mark.kafka
async def test_recorded_cli_sessions_resolve_through_the_broker(kafka: KafkaSettings) -> None:
    sessions = []
    for events in RECORDED:  # re-keyed under fresh session ids, each session written as the proxy writes it
        fresh = f"rec-{uuid.uuid4().hex[:8]}"
        sessions.append([e.model_copy(update={"session_id": fresh, "event_id": uuid.uuid4().hex}) for e in events])
    written = [list(write_session(events)) for events in sessions]
    assert all(sum(map(is_delta, w)) == len(w) - 1 for w in written)  # one keyframe per recorded session
    full_bytes = sum(len(encode_event(e)) for events in sessions for e in events)
    delta_bytes = sum(len(encode_event(e)) for w in written for e in w)
    assert delta_bytes < full_bytes / 2
    await _produce(kafka, [e for w in written for e in w])
    got, refused = await _read_resolved(kafka, sum(map(len, written)))
    assert refused == []
    by_id = {e.event_id: e for e in got}
    for events in sessions:
        for want in events:
            assert by_id[want.event_id].prompt_token_ids == want.prompt_token_ids
            assert by_id[want.event_id].request == want.request


@pytest.mark.kafka
async def test_a_generated_fifty_turn_session_resolves_through_the_broker(kafka: KafkaSettings) -> None:
    from bench.workloads import TokenSource, full_session, qwen_code_prompt

    source = TokenSource(limit_chars=300_000)
    full = list(full_session(source, np.random.default_rng(50), session_id="fifty", turns=50,
                             harness=qwen_code_prompt(), tool_result_tokens=1000))
    written = list(write_session(full))
    assert sum(map(is_delta, written)) >= 45
    await _produce(kafka, written)
    got, refused = await _read_resolved(kafka, len(written))
    assert refused == []
    assert_same(sorted(got, key=lambda e: e.sequence), full)


@pytest.mark.kafka
async def test_a_child_without_its_parent_is_dead_lettered_with_the_reason(kafka: KafkaSettings) -> None:
    written = list(write_session(generated_session(8, ["continue"] * 3, session_id="s-dl")))
    lost = written[1]
    await _produce(kafka, [e for e in written if e is not lost])  # retention took the parent, say
    got, refused = await _read_resolved(kafka, 3, dead_letters=True)
    assert [e.sequence for e in got] == [0] and refused == [written[2].event_id, written[3].event_id]
    letters: list[DeadLetter] = []
    async with EventConsumer(kafka, [Topic.DEAD_LETTER], group_id=None, dead_letters=False) as consumer:
        async def loop() -> None:
            while len(letters) < 2:
                letters.extend(r.event for r in await consumer.getmany(timeout_ms=300))  # type: ignore[misc]
        await asyncio.wait_for(loop(), 30)
    assert {d.error_type for d in letters} == {"missing_prompt_parent"}
    first = next(d for d in letters if decode_event(base64.b64decode(d.payload)).event_id == written[2].event_id)
    assert lost.event_id in first.reason and "was not read before it" in first.reason
    assert base64.b64decode(first.original_key or "") == b"s-dl"


# -- consumers ---------------------------------------------------------------------------------------------

def _sft_rows(tmp_path: Path, events: list[Completion], session_id: str) -> tuple[list[dict], dict]:
    import json

    from sinks.sft import SftCriteria, SftStore
    from tests.sinks import evaluation, trajectory

    store = SftStore(tmp_path, SftCriteria(min_reward=1.0, evaluator="tests"))
    ids = [e.event_id for e in sorted(events, key=lambda e: e.sequence)]
    for event in events:
        store.take(event)
    store.take(trajectory(session_id, "task", completion_ids=ids))
    store.take(evaluation(session_id, "task", 1.0))
    stats = store.finish()
    store.close()
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    return rows, stats


def test_the_sft_store_takes_conversations_through_the_chain(tmp_path: Path) -> None:
    full = generated_session(10, ["continue"] * 4, session_id="s-sft")
    written = write_session(full)
    [want], _ = _sft_rows(tmp_path / "full", full, "s-sft")
    [got], stats = _sft_rows(tmp_path / "delta", written, "s-sft")
    assert got["messages"] == want["messages"] and got["tools"] == want["tools"]
    assert len(got["messages"]) == len(full[-1].request.messages) + 1 and stats["completions_missing_parent"] == 0
    # The last call's parent is gone: no row from half a conversation, and the store says why.
    rows, stats = _sft_rows(tmp_path / "broken", [e for e in written if e.sequence != 3], "s-sft")
    assert rows == [] and stats["rows_without_messages"] == 1 and stats["completions_missing_parent"] == 1
