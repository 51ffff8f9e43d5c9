"""The groups worker's own topics: its ``<prefix><app id>-by-task`` re-keying topic and its table's changelog.

Both are created by schemas.transport.admin before the worker starts (the registry's topics too), never
left to Faust; the by-task topic has the ``tasks`` topic's partition count, so that a task's TaskAccepted
and its facts meet on one partition.
"""

from __future__ import annotations

from processors.worker.changelogs import changelog_topic_specs
from schemas.transport.admin import ExtraTopic, ensure_topics
from schemas.transport.settings import KafkaSettings

BY_TASK_RETENTION_MS = 7 * 24 * 3600 * 1000
# The groups worker's table (processors/groups/app.py), whose changelog is created here.
TABLES = ("tasks_state",)


def by_task_topic(kafka: KafkaSettings, app_id: str) -> str:
    """The worker's re-keying topic (facts and deadline requests, keyed by task id)."""
    return f"{kafka.topic_prefix}{app_id}-by-task"


def by_task_topic_spec(kafka: KafkaSettings, app_id: str) -> ExtraTopic:
    """The by-task topic as the admin creates it: the ``tasks`` topic's partition count, kept a week."""
    return ExtraTopic(by_task_topic(kafka, app_id), kafka.task_partitions, retention_ms=BY_TASK_RETENTION_MS)


async def prepare_topics(kafka: KafkaSettings, app_id: str) -> None:
    """Create the registry's topics, the by-task topic and the table's changelog if they are missing
    (idempotent)."""
    changelogs = changelog_topic_specs(kafka, kafka.topic_prefix + app_id, TABLES, kafka.task_partitions)
    await ensure_topics(kafka, [by_task_topic_spec(kafka, app_id), *changelogs])
