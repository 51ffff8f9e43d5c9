"""The worker's topics: the registry's (created by deploy.kafka.ensure_topics) and its own control topic.

Faust is never allowed to create or reconfigure the registry's topics: they are declared to it as
external (non-internal) topics and created from the registry before the worker starts. Faust does create
its own internal topics: the tables' changelogs. The control topic (``<app id>-control``, the timer's
requests to the agent and the "trajectory acknowledged" records) is created here, co-partitioned with the
session topics, since Faust would create an internal topic only for an agent of its own.
"""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from deploy.kafka import ensure_topics
from schemas.topics import FRAMING_BYTES
from schemas.transport.settings import KafkaSettings

_TOPIC_ALREADY_EXISTS = 36
CONTROL_RETENTION_MS = 24 * 3600 * 1000


def app_id(kafka: KafkaSettings, name: str) -> str:
    """The Faust app id (consumer group, changelog prefix): the deployment's topic prefix plus the name."""
    return kafka.topic_prefix + name


def control_topic(kafka: KafkaSettings, name: str) -> str:
    return f"{app_id(kafka, name)}-control"


def changelog_configs(kafka: KafkaSettings) -> dict[str, str]:
    """Changelog topic configs (values are small; the limit is the deployment's, as for every topic)."""
    return {"max.message.bytes": str(kafka.max_message_bytes + FRAMING_BYTES)}


async def prepare_topics(kafka: KafkaSettings, name: str) -> None:
    """Create the registry's topics and the control topic if they are missing (idempotent)."""
    await ensure_topics(kafka.kafka_bootstrap, kafka.registry(), kafka.max_message_bytes)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.kafka_bootstrap)
    try:
        await admin.start()
        topic = control_topic(kafka, name)
        if topic in set(await admin.list_topics()):
            return
        response = await admin.create_topics([NewTopic(topic, kafka.session_partitions, 1, topic_configs={
            "retention.ms": str(CONTROL_RETENTION_MS), "cleanup.policy": "delete"})])
        for entry in response.topic_errors:
            if entry[1] not in (0, _TOPIC_ALREADY_EXISTS):
                raise RuntimeError(f"creating {topic} failed: error code {entry[1]} {entry[2] if len(entry) > 2 else ''}")
    except KafkaError as exc:
        raise RuntimeError(f"Kafka at {kafka.kafka_bootstrap} refused topic set-up: {exc!r}") from exc
    finally:
        await admin.close()
