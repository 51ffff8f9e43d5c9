"""The changelog topics of a Faust worker's tables: their configs and their specs for the admin.

A changelog is the only copy of a table's state, so it gets the deployment's size limit and durability,
and it is created by schemas.transport.admin before the worker starts, never left to Faust.
"""

from __future__ import annotations

from schemas.transport.admin import ExtraTopic
from schemas.transport.settings import KafkaSettings


def changelog_configs(kafka: KafkaSettings) -> dict[str, str]:
    """Changelog topic configs (values are small; the limit is the deployment's, as for every topic), and
    the deployment's durability: a changelog is the only copy of a table's state."""
    return {"max.message.bytes": str(kafka.fetch_bytes),
            "min.insync.replicas": str(kafka.min_insync_replicas),
            "unclean.leader.election.enable": "false"}


def changelog_topic_specs(kafka: KafkaSettings, app: str, tables: tuple[str, ...], partitions: int) -> list[ExtraTopic]:
    """The changelog topics of a Faust app's tables, as Faust names them (``<app id>-<table>-changelog``),
    compacted. Created by the admin before the worker starts, so that they have the deployment's
    replication and their leaders before Faust looks for them: left to Faust on a three-node cluster, a
    replicated changelog was not yet in the metadata when the first table write asked for its partitions,
    and the worker crashed (PartitionsMismatch: 0 partitions)."""
    return [ExtraTopic(f"{app}-{table}-changelog", partitions, compacted=True) for table in tables]
