"""The typed clients' reads for readers that position themselves, and writes to a topic outside the
registry, on the real broker: values read back by (partition, offset), every partition assigned and read
from a time or the beginning up to the log's end, undecoded records decoded on demand, and a rebuild-style
output topic written and read as typed events."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from processors.trajectories.payloads import LogReadError, LogReader
from schemas.codec import HEADER_EVENT_TYPE
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, EventProducer, ExtraTopic, KafkaSettings, ensure_topics, topic_spec
from tests.samples import completion, every_event

pytestmark = pytest.mark.kafka


async def _read_until_caught_up(consumer: EventConsumer, ends: dict[TopicPartition, int]) -> list:
    got = []
    for _ in range(60):
        got += await consumer.getmany(timeout_ms=500)
        if await consumer.caught_up(ends):
            return got
    raise AssertionError(f"not caught up with {ends}")


async def test_values_are_read_back_by_partition_and_offset(kafka: KafkaSettings) -> None:
    """What the trajectory worker does on a cache miss (processors/trajectories/payloads.py): the exact record bytes."""
    events = [completion(session_id=f"s{i % 3}", sequence=i) for i in range(9)]
    async with EventProducer(kafka) as producer:
        sent = await producer.send_many(events)
    by_partition: dict[int, list[int]] = {}
    for meta in sent:
        by_partition.setdefault(meta.partition, []).append(meta.offset)
    topic = kafka.registry().name(Topic.COMPLETIONS)
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False, manual=True,
                             read_committed=False) as consumer:
        for partition, offsets in by_partition.items():
            values = await consumer.read_values(partition, [*offsets, max(offsets) + 100], timeout_s=10)
            assert sorted(values) == sorted(offsets)  # an offset past the end is absent, not waited for
            assert all(b'"event_type":"completion"' in value for value in values.values())
    reader = LogReader(kafka.kafka_bootstrap, topic, fetch_bytes=kafka.fetch_bytes)
    try:
        partition, offsets = next(iter(by_partition.items()))
        assert sorted(await reader.read(partition, offsets)) == sorted(offsets)
    finally:
        await reader.stop()


async def test_the_log_reader_tells_records_gone_from_records_not_readable_now(kafka: KafkaSettings) -> None:
    """The worker asks only for offsets it saw. One below the log's start was removed by retention: absent,
    and the session is built without it (counted lost). One at or past the start that cannot be read (past
    the end a new leader answers with, after a broker's failure) is in the log: LogReadError, and the
    build waits for it."""
    async with EventProducer(kafka) as producer:
        sent = await producer.send_many([completion(session_id="gone", sequence=i) for i in range(4)])
    partition, offsets = sent[0].partition, [meta.offset for meta in sent]
    topic = kafka.registry().name(Topic.COMPLETIONS)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.kafka_bootstrap)
    await admin.start()
    try:  # retention, by hand: the first two records leave the log
        await admin.delete_records({TopicPartition(topic, partition): RecordsToDelete(offsets[2])})
    finally:
        await admin.close()
    reader = LogReader(kafka.kafka_bootstrap, topic, fetch_bytes=kafka.fetch_bytes, timeout_s=5)
    try:
        values = await reader.read(partition, offsets)
        assert sorted(values) == offsets[2:]  # the removed ones are absent, the rest read back
        with pytest.raises(LogReadError, match=rf"offsets {offsets[-1] + 1}-{offsets[-1] + 2} of {topic}"):
            await reader.read(partition, [*offsets, offsets[-1] + 1, offsets[-1] + 2])
    finally:
        await reader.stop()


async def test_a_manual_consumer_has_no_group() -> None:
    with pytest.raises(ValueError, match="no group"):
        EventConsumer(KafkaSettings(), [Topic.SESSIONS], group_id="g", manual=True)


async def test_every_partition_is_read_from_a_time_up_to_the_end(kafka: KafkaSettings) -> None:
    async with EventProducer(kafka) as producer:
        await producer.send_many([completion(session_id=f"early{i}") for i in range(4)])
        await asyncio.sleep(0.2)
        since_ms = int(time.time() * 1000)
        await producer.send_many([completion(session_id=f"late{i}") for i in range(4)])
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        partitions = await consumer.wait_for_assignment()
        assert partitions == [TopicPartition(kafka.registry().name(Topic.COMPLETIONS), p)
                              for p in range(kafka.session_partitions)]
        await consumer.seek_to_time(since_ms)
        ends = await consumer.end_offsets()
        late = await _read_until_caught_up(consumer, ends)
        assert sorted(r.event.session_id for r in late) == [f"late{i}" for i in range(4)]
        await consumer.seek_to_beginning()
        everything = await _read_until_caught_up(consumer, ends)
    # From the beginning again: the late ones are duplicates by event id now, and dropped.
    assert sorted(r.event.session_id for r in everything) == [f"early{i}" for i in range(4)]
    assert consumer.duplicates_skipped == 4


async def test_raw_records_are_decoded_on_demand(kafka: KafkaSettings) -> None:
    async with EventProducer(kafka) as producer:
        await producer.send(completion(session_id="raw"))
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        raw = []
        for _ in range(20):
            raw += await consumer.getmany_raw(timeout_ms=500)
            if raw:
                break
        [record] = raw
        assert record.key == b"raw" and dict(record.headers)[HEADER_EVENT_TYPE] == b"completion"
        received = await consumer.take(record)
        assert received is not None and received.event.session_id == "raw" and received.offset == record.offset
        assert await consumer.take(record) is None  # the same event again: a duplicate
        assert await consumer.lag() == 0


async def test_events_go_to_a_topic_outside_the_registry(kafka: KafkaSettings) -> None:
    """A rebuild writes trajectories to a topic of its own (``rollwire rebuild --to``), stamped and keyed as
    every event; a reader gives the topic's spec (what the registry's trajectories topic holds)."""
    name = kafka.topic_prefix + "rebuilt"
    await ensure_topics(kafka, [ExtraTopic.like(kafka.registry().spec(Topic.TRAJECTORIES), name)])
    trajectory = next(e for e in every_event() if isinstance(e, Trajectory))
    async with EventProducer(kafka, service="rebuild") as producer:
        [meta] = await producer.send_many([trajectory], to=name)
        assert meta.topic == name
    spec = topic_spec(kafka, name, like=Topic.TRAJECTORIES)
    assert spec.name == name and spec.event_types == kafka.registry().spec(Topic.TRAJECTORIES).event_types
    async with EventConsumer(kafka, [spec], group_id=None, dead_letters=False) as consumer:
        await consumer.wait_for_assignment()
        [got] = await _read_until_caught_up(consumer, await consumer.end_offsets())
    assert got.topic == name and got.key == trajectory.key()
    assert got.event.event_id == trajectory.event_id and got.event.source.startswith("rebuild@")
    assert got.event.emitted_at is not None
