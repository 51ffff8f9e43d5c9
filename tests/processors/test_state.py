"""A worker's RocksDB state lives under the Kafka cluster's id (processors/worker/state.py)."""

from __future__ import annotations

from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from processors.worker.state import cluster_state_dir


async def test_state_dir_is_keyed_by_the_cluster_id(kafka_bootstrap: str, tmp_path: Path) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        cluster = (await admin.describe_cluster())["cluster_id"]
    finally:
        await admin.close()
    first = await cluster_state_dir(tmp_path, kafka_bootstrap)
    assert first.is_dir() and first.parent == tmp_path and first.name.endswith(cluster.replace("/", "_"))
    assert await cluster_state_dir(tmp_path, kafka_bootstrap) == first  # the same cluster: the same state
    # State left by another cluster (a wiped and recreated broker) is never the folder used.
    (tmp_path / "cluster-another").mkdir()
    assert await cluster_state_dir(tmp_path, kafka_bootstrap) == first
