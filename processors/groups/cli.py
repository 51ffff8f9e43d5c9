"""``rollwire groups``: run a groups worker (Faust) in the foreground.

Reads Kafka settings from ``ROLLWIRE_*`` and the worker's own from ``ROLLWIRE_GROUPS_*`` (settings.py).
Creates the registry's topics and the worker's ``<prefix><app id>-by-task`` topic (the ``tasks`` topic's
partition count) first if they are missing.
"""

from __future__ import annotations

import asyncio

from processors.topics import changelog_topic_specs
from schemas.transport.admin import ExtraTopic, ensure_topics
from schemas.transport.settings import KafkaSettings

BY_TASK_RETENTION_MS = 7 * 24 * 3600 * 1000


def by_task_topic(kafka: KafkaSettings, app_id: str) -> str:
    """The worker's re-keying topic (facts and deadline requests, keyed by task id)."""
    return f"{kafka.topic_prefix}{app_id}-by-task"


def by_task_topic_spec(kafka: KafkaSettings, app_id: str) -> ExtraTopic:
    """The by-task topic as the admin creates it: the ``tasks`` topic's partition count, kept a week."""
    return ExtraTopic(by_task_topic(kafka, app_id), kafka.task_partitions, retention_ms=BY_TASK_RETENTION_MS)


async def prepare_topics(kafka: KafkaSettings, app_id: str) -> None:
    """Create the registry's topics, the by-task topic and the table's changelog if they are missing
    (idempotent)."""
    changelogs = changelog_topic_specs(kafka, kafka.topic_prefix + app_id, ("tasks_state",), kafka.task_partitions)
    await ensure_topics(kafka, [by_task_topic_spec(kafka, app_id), *changelogs])


def run() -> None:
    """Run a groups worker: trajectories + evaluations + tasks -> groups with GRPO advantages."""
    from processors.faust_worker import run_worker
    from processors.groups.settings import GroupSettings

    conf, kafka = GroupSettings(), KafkaSettings()
    asyncio.run(prepare_topics(kafka, conf.app_id))
    run_worker("processors.groups.app", kafka=kafka, data_dir=conf.data_dir, data_dir_var="ROLLWIRE_GROUPS_DATA_DIR",
               log_level=conf.log_level, event_loop=conf.event_loop)
