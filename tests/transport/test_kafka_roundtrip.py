"""Typed producing and consuming against the project's real Apache Kafka broker."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from schemas.dead_letter import DeadLetter
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings, Received
from schemas.transport.errors import EventTooLargeError, PublishError
from tests.samples import completion, every_event

pytestmark = pytest.mark.kafka


async def drain(consumer: EventConsumer, want: int, timeout_s: float = 30.0) -> list[Received]:
    """Receive until ``want`` events arrived (fails the test on timeout)."""
    got: list[Received] = []

    async def loop() -> None:
        while len(got) < want:
            got.extend(await consumer.getmany(timeout_ms=500))

    await asyncio.wait_for(loop(), timeout_s)
    return got


async def test_every_event_type_round_trips_through_kafka(kafka: KafkaSettings) -> None:
    events = every_event()
    async with EventProducer(kafka, service="test") as producer:
        await producer.send_many(events)
    topics = sorted({e.topic for e in events}, key=lambda t: t.value)
    async with EventConsumer(kafka, topics, group_id=None, dead_letters=False) as consumer:
        received = await drain(consumer, len(events))
    by_id = {r.event.event_id: r for r in received}
    for event in events:
        got = by_id[event.event_id]
        assert got.event.model_copy(update={"emitted_at": None, "source": None}) == event
        assert got.event.emitted_at is not None and got.event.source.startswith("test@")
        assert got.key == event.key() and got.topic == kafka.registry().name(event.topic)


async def test_a_200k_token_session_completion_survives(kafka: KafkaSettings) -> None:
    rng = np.random.default_rng(1)
    event = completion(prompt_len=200_000, sampled_len=4_000).model_copy(update={
        "prompt_token_ids": rng.integers(0, 151_936, 200_000).astype(np.int32),
    })
    async with EventProducer(kafka) as producer:
        await producer.send(event)
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        [got] = await drain(consumer, 1)
    assert len(got.event.prompt_token_ids) == 200_000
    assert got.event.prompt_token_ids == event.prompt_token_ids
    assert got.event.logprobs == event.logprobs


async def test_too_large_event_is_refused_before_sending(kafka: KafkaSettings) -> None:
    small = kafka.model_copy(update={"max_message_bytes": 1024 * 1024})
    async with EventProducer(small) as producer:
        with pytest.raises(EventTooLargeError, match="ROLLWIRE_MAX_MESSAGE_BYTES"):
            await producer.send(completion(prompt_len=400_000))


async def test_unreachable_broker_is_a_publish_error() -> None:
    settings = KafkaSettings(kafka_bootstrap="127.0.0.1:1", kafka_request_timeout_ms=1000)
    with pytest.raises(PublishError, match="cannot reach Kafka"):
        async with EventProducer(settings):
            pass


async def test_redelivered_event_ids_are_dropped(kafka: KafkaSettings) -> None:
    event = completion(session_id="dup")
    async with EventProducer(kafka) as producer:
        await producer.send(event)
        await producer.send(event)  # an upstream retry of the same event
        await producer.send(completion(session_id="dup", sequence=1))
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        received = await drain(consumer, 2)
        received += await consumer.getmany(timeout_ms=1500)
    assert [r.event.sequence for r in received] == [0, 1]
    assert consumer.duplicates_skipped == 1


async def test_poison_records_go_to_dead_letter_and_the_consumer_carries_on(kafka: KafkaSettings) -> None:
    topic = kafka.registry().name(Topic.COMPLETIONS)
    good = completion(session_id="s-good")
    raw = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap, acks="all")
    await raw.start()
    try:
        await raw.send_and_wait(topic, b"{not json", key=b"s-good")
        await raw.send_and_wait(topic, b'{"event_type": "weird", "schema_version": 1}', key=b"s-good")
        await raw.send_and_wait(topic, every_event()[-2].model_dump_json().encode(), key=b"s-good")  # a group
    finally:
        await raw.stop()
    async with EventProducer(kafka) as producer:
        await producer.send(good)
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id="g-poison") as consumer:
        [received] = await drain(consumer, 1)
        await consumer.commit()
        assert consumer.dead_lettered == 3
    assert received.event == good.model_copy(update={"emitted_at": received.event.emitted_at,
                                                      "source": received.event.source})
    async with EventConsumer(kafka, [Topic.DEAD_LETTER], group_id=None, dead_letters=False) as dlq:
        letters = [r.event for r in await drain(dlq, 3)]
    assert all(isinstance(letter, DeadLetter) for letter in letters)
    assert sorted(letter.error_type for letter in letters) == ["invalid_json", "unknown_event_type", "wrong_topic"]
    for letter in letters:
        assert letter.source_topic == topic and letter.consumer_group == "g-poison"
        assert base64.b64decode(letter.original_key) == b"s-good"
        assert letter.reason
    assert base64.b64decode(next(x for x in letters if x.error_type == "invalid_json").payload) == b"{not json"


async def test_group_members_share_partitions_and_take_over(kafka: KafkaSettings) -> None:
    group = f"g-{uuid.uuid4().hex[:6]}"
    sessions = [f"s{i}" for i in range(24)]  # enough keys to land on every partition
    first_round = [completion(session_id=s, sequence=0) for s in sessions]
    second_round = [completion(session_id=s, sequence=1) for s in sessions]

    a = EventConsumer(kafka, [Topic.COMPLETIONS], group_id=group, service="node-a")
    b = EventConsumer(kafka, [Topic.COMPLETIONS], group_id=group, service="node-b")
    await a.start()
    await b.start()
    try:
        async with EventProducer(kafka) as producer:
            await producer.send_many(first_round)
        got_a: list[Received] = []
        got_b: list[Received] = []

        async def both_received() -> None:
            while len(got_a) + len(got_b) < len(first_round):
                got_a.extend(await a.getmany(timeout_ms=200))
                got_b.extend(await b.getmany(timeout_ms=200))

        await asyncio.wait_for(both_received(), 60)
        # Both members own partitions: the work is shared, and nothing was read twice.
        assert got_a and got_b
        assert {r.partition for r in got_a}.isdisjoint({r.partition for r in got_b})
        assert sorted(r.event.session_id for r in got_a + got_b) == sorted(sessions)
        await a.commit()
        await b.commit()
        partitions_of_a = {r.partition for r in got_a}

        # Member a dies; b takes over its partitions and receives everything that follows.
        await a.stop()
        async with EventProducer(kafka) as producer:
            await producer.send_many(second_round)
        taken = await drain(b, len(second_round), timeout_s=60)
        assert sorted(r.event.session_id for r in taken) == sorted(sessions)
        assert partitions_of_a <= {r.partition for r in taken}
        assert all(r.event.sequence == 1 for r in taken)  # committed work is not redelivered
    finally:
        await a.stop()
        await b.stop()


async def test_uncommitted_work_is_redelivered_to_the_next_member(kafka: KafkaSettings) -> None:
    """At-least-once: a member that dies before committing leaves its records to the next one."""
    group = f"g-{uuid.uuid4().hex[:6]}"
    events = [completion(session_id=f"r{i}") for i in range(8)]
    async with EventProducer(kafka) as producer:
        await producer.send_many(events)
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=group) as first:
        await drain(first, len(events))  # processed, but never committed
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=group) as second:
        again = await drain(second, len(events))
    assert sorted(r.event.event_id for r in again) == sorted(e.event_id for e in events)



async def test_transactions_work_on_the_single_node(kafka: KafkaSettings) -> None:
    """The local broker is configured for transactions: aborted sends stay invisible to our readers."""
    kept, dropped = completion(session_id="txn", sequence=0), completion(session_id="txn", sequence=1)
    async with EventProducer(kafka, transactional_id=f"test-{uuid.uuid4().hex[:6]}") as producer:
        async with producer.transaction():
            await producer.send(kept)
        with pytest.raises(RuntimeError, match="abort"):
            async with producer.transaction():
                await producer.send(dropped)
                raise RuntimeError("abort this transaction")
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        received = await drain(consumer, 1)
        received += await consumer.getmany(timeout_ms=1500)
    assert [r.event.event_id for r in received] == [kept.event_id]


async def test_transaction_needs_an_id(kafka: KafkaSettings) -> None:
    async with EventProducer(kafka) as producer:
        with pytest.raises(ValueError, match="transactional_id"):
            producer.transaction()
