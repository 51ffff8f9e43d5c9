"""processors.trajectories.continuity: records the stream skips are found and read back, records it repeats are skipped.

The classification is checked on its own; the read-back and the committed offsets against the real broker
(a topic written by the project's producer, a group's offsets committed by a real consumer).
"""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from processors.trajectories.continuity import DUPLICATE, NEXT, Gap, InputContinuity, RangeReader
from schemas.topics import Topic
from schemas.transport import KafkaSettings
from schemas.transport.admin import ExtraTopic, KafkaAdmin


def test_a_partition_is_handled_from_its_committed_offset_without_holes_or_repeats() -> None:
    continuity = InputContinuity()
    # Before the baseline nothing is known: every record is handled as it comes.
    assert continuity.admit("completions", 0, 7) == NEXT
    assert continuity.committed("completions", 0) is None
    continuity.baseline({("completions", 0): 10, ("sessions", 0): 0})
    assert continuity.committed("completions", 0) == 10
    # Below the committed offset: the previous owner's work, already in the tables.
    assert continuity.admit("completions", 0, 9) == DUPLICATE
    assert continuity.admit("completions", 0, 10) == NEXT
    continuity.handled("completions", 0, 10)
    # Handed out again after it was handled.
    assert continuity.admit("completions", 0, 10) == DUPLICATE
    # 11 and 12 never handed out: a gap to read back before 13.
    assert continuity.admit("completions", 0, 13) == Gap("completions", 0, 11, 13)
    continuity.handled("completions", 0, 13)
    assert continuity.admit("completions", 0, 12) == DUPLICATE
    assert continuity.admit("completions", 0, 14) == NEXT
    # Another partition has its own offsets; one not in the baseline is trusted.
    assert continuity.admit("sessions", 0, 2) == Gap("sessions", 0, 0, 2)
    assert continuity.admit("sessions", 1, 5) == NEXT
    assert continuity.counters == {"duplicates_skipped": 3, "gaps": 2, "gap_offsets": 4, "tails_read": 0}
    continuity.reset()
    assert not continuity.baselined and continuity.admit("completions", 0, 3) == NEXT


def test_a_hole_at_a_partition_end_is_named_once_the_stream_is_quiet_about_it() -> None:
    """No later record reveals a hole at the end: the worker asks which partitions' inputs end past the next
    offset while the stream has handed out nothing of them for a while, and reads those ends back."""
    continuity = InputContinuity()
    inputs = {"completions", "sessions"}
    ends = {("completions", 0): 12, ("sessions", 0): 3, ("completions", 1): 5, ("control", 0): 9}
    highwater = lambda topic, partition: ends.get((topic, partition))  # noqa: E731
    assert continuity.partitions_behind(highwater, 100.0, 2.0, inputs) == set()  # before the baseline
    continuity.baseline({("completions", 0): 10, ("sessions", 0): 3, ("completions", 1): 5, ("control", 0): 0})
    continuity.admit("completions", 0, 10, now=99.5)
    continuity.handled("completions", 0, 10)
    # completions[0] ends at 12, 11 not handed out, but the stream spoke of it 0.5 s ago: not yet.
    assert continuity.behind(0, highwater, 100.0, 2.0, inputs) == []
    # Quiet for long enough: the end [11, 12) is to be read back; the control topic is not a session input.
    assert continuity.behind(0, highwater, 102.0, 2.0, inputs) == [Gap("completions", 0, 11, 12)]
    assert continuity.partitions_behind(highwater, 102.0, 2.0, inputs) == {0}
    continuity.read_to(Gap("completions", 0, 11, 12))
    assert continuity.partitions_behind(highwater, 102.0, 2.0, inputs) == set()
    assert continuity.admit("completions", 0, 11, now=103.0) == DUPLICATE  # handed out late: a repeat
    assert continuity.counters["tails_read"] == 1


@pytest.mark.kafka
async def test_a_gap_is_read_back_from_the_log_and_the_group_offsets_are_where_it_left(kafka: KafkaSettings) -> None:
    topic = kafka.topic_prefix + "continuity"
    async with KafkaAdmin(kafka.kafka_bootstrap) as admin:
        await admin.create([ExtraTopic(topic, partitions=2)])
    producer = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(12):
            await producer.send_and_wait(topic, f"v{i}".encode(), key=f"s{i % 3}".encode(), partition=1)
        await producer.send_and_wait(topic, b"other", key=b"x", partition=0)
    finally:
        await producer.stop()

    group = kafka.topic_prefix + "group"
    member = AIOKafkaConsumer(bootstrap_servers=kafka.kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await member.start()
    try:
        member.assign([TopicPartition(topic, 1)])
        await member.commit({TopicPartition(topic, 1): OffsetAndMetadata(5, "")})
    finally:
        await member.stop()

    reader = RangeReader(kafka, {topic: Topic.SESSION_EVENTS})
    try:
        committed = await reader.committed(group, [(topic, 0), (topic, 1)])
        # Partition 1 where the group left it; partition 0 never committed: from the log's start.
        assert committed == {(topic, 0): 0, (topic, 1): 5}
        back = await reader.read(Gap(topic, 1, 5, 9))
        assert [(r.offset, r.key, r.value) for r in back] == [(o, f"s{o % 3}".encode(), f"v{o}".encode())
                                                             for o in range(5, 9)]
        assert all(r.topic == topic and r.partition == 1 and r.timestamp > 1e9 for r in back)
        # Past the end of the log: nothing (the offsets are not there yet).
        assert await reader.read(Gap(topic, 1, 12, 20)) == []
        # A gap read again, reusing the reader's consumer.
        assert [r.offset for r in await reader.read(Gap(topic, 1, 0, 2))] == [0, 1]
    finally:
        await reader.stop()
