"""Topic administration (schemas/transport/admin.py) on the real broker: the registry's topics and the
workers' extra topics are created with the deployment's limits, a partition count that disagrees with the
registry is refused, concurrent set-ups both succeed, a prefix's topics are deleted, and the cluster is
described. Every test works under its own fresh prefix."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

import deploy.errors
from processors.groups.topics import by_task_topic_spec
from processors.trajectories.topics import CONTROL_RETENTION_MS, control_topic_spec
from schemas.topics import FRAMING_BYTES, MAX_MESSAGE_BYTES, Topic
from schemas.transport import KafkaSettings, TransportError
from schemas.transport.admin import (
    ExtraTopic,
    KafkaAdmin,
    broker_answers,
    cluster_id,
    delete_topics,
    ensure_topics,
)
from schemas.transport.errors import TopicSetupError
from tests.servers import free_port

pytestmark = pytest.mark.kafka


async def _topic_configs(bootstrap: str, names: list[str]) -> dict[str, dict[str, str]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
    finally:
        await admin.close()
    return {name: {entry[0]: entry[1] for entry in entries}
            for response in responses for _code, _msg, _type, name, entries in response.resources}


async def _partition_counts(bootstrap: str, names: list[str]) -> dict[str, int]:
    async with KafkaAdmin(bootstrap) as admin:
        return await admin.partition_counts(names)


async def test_ensure_topics_creates_the_registry(settings: KafkaSettings) -> None:
    registry = settings.registry()
    names = [spec.name for spec in registry.specs()]
    created = await ensure_topics(settings)
    assert sorted(created) == sorted(names)
    assert await _partition_counts(settings.kafka_bootstrap, names) == {s.name: s.partitions for s in registry.specs()}
    configs = await _topic_configs(settings.kafka_bootstrap, names)
    for spec in registry.specs():
        assert configs[spec.name]["max.message.bytes"] == str(MAX_MESSAGE_BYTES + FRAMING_BYTES), spec.name
        assert configs[spec.name]["retention.ms"] == str(spec.retention_ms), spec.name
    assert configs[registry.name(Topic.SESSIONS)]["cleanup.policy"] == "compact"
    assert configs[registry.name(Topic.COMPLETIONS)]["cleanup.policy"] == "delete"


async def test_ensure_topics_again_creates_nothing(settings: KafkaSettings) -> None:
    await ensure_topics(settings)
    assert await ensure_topics(settings) == []


async def test_describing_a_topic_that_never_appears_is_an_error(settings: KafkaSettings) -> None:
    """A topic not known yet is asked about again for a while (a cluster node may not have heard of a new
    one); one that never appears is still an error naming why."""
    async with KafkaAdmin(settings.kafka_bootstrap) as admin:
        with pytest.raises(TransportError, match="UnknownTopicOrPartitionError"):
            await admin.partitions(f"{settings.topic_prefix}never-created", unknown_wait_s=0.5)


async def test_more_replicas_than_brokers_is_refused_naming_the_setting(settings: KafkaSettings) -> None:
    """One broker, three replicas asked: refused at once (the brokers listed are too few to wait for)."""
    async with KafkaAdmin(settings.kafka_bootstrap) as admin:
        with pytest.raises(TopicSetupError, match="fewer live brokers than 3 replicas .ROLLWIRE_REPLICATION_FACTOR"):
            await admin.create([ExtraTopic(f"{settings.topic_prefix}three-replicas", 1)], replication_factor=3)


async def test_partition_count_disagreement_is_refused(settings: KafkaSettings) -> None:
    await ensure_topics(settings)
    other = settings.model_copy(update={"session_partitions": settings.session_partitions + 1})
    with pytest.raises(TopicSetupError, match="partitions but the registry wants") as raised:
        await ensure_topics(other)
    # One error for topic set-up, whoever asks: the transport's, and deploy's name for it.
    assert isinstance(raised.value, TransportError) and isinstance(raised.value, deploy.errors.TopicSetupError)


async def test_extra_topics_get_their_partitions_retention_and_the_size_limit(settings: KafkaSettings) -> None:
    """The workers' own topics (the control topic, the by-task topic, a rebuild's output topic) are created
    by the same call as the registry's, with the deployment's message size limit."""
    rebuilt = ExtraTopic.like(settings.registry().spec(Topic.TRAJECTORIES), settings.topic_prefix + "rebuilt")
    extra = [control_topic_spec(settings, "processors"), by_task_topic_spec(settings, "groups"), rebuilt]
    created = await ensure_topics(settings, extra)
    names = [t.name for t in extra]
    assert set(names) <= set(created)
    assert await _partition_counts(settings.kafka_bootstrap, names) == {
        names[0]: settings.session_partitions, names[1]: settings.task_partitions,
        names[2]: settings.session_partitions}
    configs = await _topic_configs(settings.kafka_bootstrap, names)
    for name in names:
        assert configs[name]["max.message.bytes"] == str(settings.max_message_bytes + FRAMING_BYTES), name
        assert configs[name]["cleanup.policy"] == "delete", name
    assert configs[names[0]]["retention.ms"] == str(CONTROL_RETENTION_MS)
    assert configs[names[2]]["retention.ms"] == "-1"
    assert await ensure_topics(settings, extra) == []


async def test_two_concurrent_set_ups_both_succeed(settings: KafkaSettings) -> None:
    """Two workers starting at once race to create the same topics: the loser's "already exists" is not an
    error, and each topic is created exactly once."""
    extra = [control_topic_spec(settings, "processors")]
    first, second = await asyncio.gather(ensure_topics(settings, extra), ensure_topics(settings, extra))
    everything = {spec.name for spec in settings.registry().specs()} | {extra[0].name}
    assert set(first) | set(second) == everything
    assert not set(first) & set(second)


async def test_delete_topics_deletes_only_the_prefix(settings: KafkaSettings, kafka: KafkaSettings) -> None:
    await ensure_topics(settings, [control_topic_spec(settings, "processors")])
    deleted = await delete_topics(settings.kafka_bootstrap, settings.topic_prefix)
    assert len(deleted) == len(Topic) + 1 and all(name.startswith(settings.topic_prefix) for name in deleted)
    async with KafkaAdmin(settings.kafka_bootstrap) as admin:
        for _ in range(100):  # the broker drops deleted topics from its metadata shortly after it answers
            remaining = await admin.topic_names()
            if not any(name.startswith(settings.topic_prefix) for name in remaining):
                break
            await asyncio.sleep(0.1)
    assert not {name for name in remaining if name.startswith(settings.topic_prefix)}
    assert kafka.registry().name(Topic.COMPLETIONS) in remaining  # another prefix's topics are untouched
    with pytest.raises(ValueError, match="without a prefix"):
        await delete_topics(settings.kafka_bootstrap, "")


async def test_the_cluster_is_described(kafka_bootstrap: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        expected = (await admin.describe_cluster())["cluster_id"]
    finally:
        await admin.close()
    assert await cluster_id(kafka_bootstrap) == expected
    async with KafkaAdmin(kafka_bootstrap) as described:
        assert await described.group_client_ids(f"nobody-{uuid.uuid4().hex[:8]}") == []


async def test_broker_answers_says_whether_kafka_is_there(kafka_bootstrap: str) -> None:
    assert await asyncio.to_thread(broker_answers, kafka_bootstrap, 10)
    assert broker_answers(kafka_bootstrap, 10)  # from a running event loop too
    assert not broker_answers(f"127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="host:port"):
        broker_answers("localhost")


async def test_an_unreachable_broker_is_a_topic_setup_error() -> None:
    unreachable = KafkaSettings(kafka_bootstrap=f"127.0.0.1:{free_port()}", topic_prefix="never.")
    with pytest.raises(TopicSetupError):
        await ensure_topics(unreachable, timeout_s=3)
