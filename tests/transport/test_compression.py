"""Who compresses the log, on the real broker: the topics the proxy writes compress with zstd, so a batch
a producer sends uncompressed (the proxy's capture) is stored compressed; a topic created before that
(``compression.type=producer``) keeps batches as they come, which is what ``capture_compression=auto``
reads (proxy.capture.settle_compression) before it lets the proxy send uncompressed.

What is checked is the stored batches' codec, as the broker hands them to a fetch."""

from __future__ import annotations

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from proxy.capture import settle_compression
from schemas.sessions import SessionSpec
from schemas.topics import BROKER_COMPRESSION, Topic
from schemas.transport import EventProducer, KafkaAdmin, KafkaSettings, TransportError
from schemas.transport.admin import ensure_topics
from tests.kafka_batches import stored_codecs

pytestmark = pytest.mark.kafka


def _specs(count: int) -> list[SessionSpec]:
    # Compressible, as a harness's messages are: the same system prompt again and again.
    instruction = "Fix the failing test in the repository, then run the suite. " * 200
    return [SessionSpec(session_id=f"s-{i}", task_id="t", instruction=instruction) for i in range(count)]


async def _send(settings: KafkaSettings, compress: bool) -> None:
    async with EventProducer(settings, compress=compress) as producer:
        await producer.send_many(_specs(6))


async def test_the_proxys_topics_compress_what_arrives_uncompressed(settings: KafkaSettings) -> None:
    await ensure_topics(settings)
    compressing = {spec.topic for spec in settings.registry().specs() if spec.compression != "producer"}
    assert compressing == {Topic.COMPLETIONS, Topic.SESSIONS}  # the rest keep their producers' (snappy) batches
    topic = settings.registry().name(Topic.SESSIONS)
    async with KafkaAdmin(settings.kafka_bootstrap) as admin:
        assert await admin.topic_config(topic, "compression.type") == BROKER_COMPRESSION == "zstd"
    await _send(settings, compress=False)
    await _send(settings, compress=True)
    codecs = await stored_codecs(settings.kafka_bootstrap, topic, settings.session_partitions)
    assert codecs and set(codecs) == {"zstd"}, codecs
    assert await settle_compression(settings, 10.0) == "broker"


async def test_a_topic_that_keeps_the_producers_batches_is_left_to_the_producer(settings: KafkaSettings) -> None:
    # Topics as rollwire created them before: compression.type=producer.
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(spec.name, spec.partitions, 1, topic_configs={"compression.type": "producer"})
                                   for spec in settings.registry().specs()])
    finally:
        await admin.close()
    await ensure_topics(settings)  # kept as they are
    assert await settle_compression(settings, 10.0) == "producer"

    topic = settings.registry().name(Topic.SESSIONS)
    await _send(settings, compress=False)
    stored = await stored_codecs(settings.kafka_bootstrap, topic, settings.session_partitions)
    assert stored and set(stored) == {"none"}, stored  # what auto avoids: an uncompressed log
    await _send(settings, compress=True)
    stored = await stored_codecs(settings.kafka_bootstrap, topic, settings.session_partitions)
    assert "zstd" in stored and "none" in stored, stored


async def test_settling_without_the_topic_is_an_error(settings: KafkaSettings) -> None:
    with pytest.raises(TransportError, match="UnknownTopicOrPartition"):
        await settle_compression(settings, 10.0)
