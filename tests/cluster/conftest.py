"""Fixtures for the replicated-cluster tests: a real three-node KRaft cluster from the project's
Maven jars, on free ports in a temporary home, started once per test run and stopped at its end.

Each node is a small JVM (``CLUSTER_HEAP``). A test that kills a node restarts it before it returns
(``restarted``), so that the next test finds all three up; topics live under a fresh prefix per test.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from deploy.kafka import KafkaConfig
from deploy.kafka_cluster import KafkaCluster
from schemas.transport.admin import delete_topics, ensure_topics
from schemas.transport.settings import KafkaSettings
from tests.servers import free_port

CLUSTER_HEAP = "-Xms128m -Xmx384m"


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """Three combined broker+controller nodes, replication 3 with two in sync."""
    base = KafkaConfig.from_env()
    config = KafkaConfig(version=base.version, cache_dir=base.cache_dir, home=tmp_path_factory.mktemp("cluster"),
                         heap=CLUSTER_HEAP, max_message_bytes=base.max_message_bytes)
    cluster = KafkaCluster(config, 3, [(free_port(), free_port()) for _ in range(3)])
    cluster.start(timeout_s=240)
    try:
        yield cluster
    finally:
        cluster.stop(timeout_s=20)


@pytest.fixture
def restarted(kafka_cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The cluster, with every node that a test killed started again afterwards."""
    yield kafka_cluster
    kafka_cluster.start(timeout_s=180)


@pytest.fixture
async def cluster_kafka(kafka_cluster: KafkaCluster) -> AsyncIterator[KafkaSettings]:
    """Settings for fresh topics (unique prefix) on the cluster, replicated three times, topics created."""
    settings = kafka_cluster.settings(KafkaSettings(topic_prefix=f"c{uuid.uuid4().hex[:10]}.",
                                                    session_partitions=6, task_partitions=3))
    await ensure_topics(settings)
    yield settings
    await delete_topics(settings.kafka_bootstrap, settings.topic_prefix)
