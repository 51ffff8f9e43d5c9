"""``rollwire groups``: run a groups worker (Faust) in the foreground.

Reads Kafka settings from ``ROLLWIRE_*`` and the worker's own from ``ROLLWIRE_GROUPS_*`` (settings.py).
Creates the registry's topics and the worker's ``<prefix><app id>-by-task`` topic (the ``tasks`` topic's
partition count) first if they are missing.
"""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from schemas.topics import FRAMING_BYTES
from schemas.transport.settings import KafkaSettings

_TOPIC_ALREADY_EXISTS = 36
BY_TASK_RETENTION_MS = 7 * 24 * 3600 * 1000


def by_task_topic(kafka: KafkaSettings, app_id: str) -> str:
    """The worker's re-keying topic (facts and deadline requests, keyed by task id)."""
    return f"{kafka.topic_prefix}{app_id}-by-task"


async def prepare_topics(kafka: KafkaSettings, app_id: str) -> None:
    """Create the registry's topics and the by-task topic if they are missing (idempotent)."""
    from deploy.kafka import ensure_topics

    await ensure_topics(kafka.kafka_bootstrap, kafka.registry(), kafka.max_message_bytes)
    topic = by_task_topic(kafka, app_id)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.kafka_bootstrap)
    try:
        await admin.start()
        if topic in set(await admin.list_topics()):
            return
        response = await admin.create_topics([NewTopic(topic, kafka.task_partitions, 1, topic_configs={
            "retention.ms": str(BY_TASK_RETENTION_MS), "cleanup.policy": "delete",
            "max.message.bytes": str(kafka.max_message_bytes + FRAMING_BYTES)})])
        for entry in response.topic_errors:
            if entry[1] not in (0, _TOPIC_ALREADY_EXISTS):
                raise RuntimeError(f"creating {topic} failed: error code {entry[1]}")
    except KafkaError as exc:
        raise RuntimeError(f"Kafka at {kafka.kafka_bootstrap} refused topic set-up: {exc!r}") from exc
    finally:
        await admin.close()


def run() -> None:
    """Run a groups worker: trajectories + evaluations + tasks -> groups with GRPO advantages."""
    from processors.faust_worker import run_worker
    from processors.groups.settings import GroupSettings

    conf, kafka = GroupSettings(), KafkaSettings()
    asyncio.run(prepare_topics(kafka, conf.app_id))
    run_worker("processors.groups.app", kafka=kafka, data_dir=conf.data_dir, data_dir_var="ROLLWIRE_GROUPS_DATA_DIR",
               log_level=conf.log_level)
