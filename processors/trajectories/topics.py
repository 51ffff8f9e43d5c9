"""The worker's topics: the registry's and its own control topic, both created by schemas.transport.admin.

Faust is never allowed to create or reconfigure the registry's topics: they are declared to it as
external (non-internal) topics and created from the registry before the worker starts. Faust does create
its own internal topics: the tables' changelogs. The control topic (``<app id>-control``, the timer's
requests to the agent and the "trajectory acknowledged" records) is created here, co-partitioned with the
session topics, since Faust would create an internal topic only for an agent of its own.
"""

from __future__ import annotations

from processors.worker.changelogs import changelog_topic_specs
from schemas.transport.admin import ExtraTopic, ensure_topics
from schemas.transport.settings import KafkaSettings

CONTROL_RETENTION_MS = 24 * 3600 * 1000
# The trajectory worker's tables (processors/trajectories/app.py), whose changelogs are created here.
TABLES = ("open_sessions", "session_specs", "built_sessions")


def app_id(kafka: KafkaSettings, name: str) -> str:
    """The Faust app id (consumer group, changelog prefix): the deployment's topic prefix plus the name."""
    return kafka.topic_prefix + name


def control_topic(kafka: KafkaSettings, name: str) -> str:
    return f"{app_id(kafka, name)}-control"


def control_topic_spec(kafka: KafkaSettings, name: str) -> ExtraTopic:
    """The control topic as the admin creates it: the session topics' partition count, kept a day."""
    return ExtraTopic(control_topic(kafka, name), kafka.session_partitions, retention_ms=CONTROL_RETENTION_MS)


async def prepare_topics(kafka: KafkaSettings, name: str) -> None:
    """Create the registry's topics, the control topic and the tables' changelogs if they are missing
    (idempotent)."""
    await ensure_topics(kafka, [control_topic_spec(kafka, name),
                                *changelog_topic_specs(kafka, app_id(kafka, name), TABLES, kafka.session_partitions)])
