"""What the broker stores, below the records: the codec of each record batch of a topic, as a fetch
returns them (aiokafka's consumer decompresses batches without saying how they were stored)."""

from __future__ import annotations

from aiokafka import TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.default_records import DefaultRecordBatch
from aiokafka.record.memory_records import MemoryRecords

CODECS = {DefaultRecordBatch.CODEC_NONE: "none", DefaultRecordBatch.CODEC_ZSTD: "zstd"}


async def stored_codecs(bootstrap: str, topic: str, partitions: int) -> list[str]:
    """The codec of every batch stored in ``topic``, fetched from each partition's leader."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        client.add_topic(topic)
        await client.force_metadata_update()
        codecs: list[str] = []
        for partition in range(partitions):
            leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
            assert leader is not None and leader >= 0, f"{topic}[{partition}] has no leader"
            response = await client.send(leader, FetchRequest(100, 1, 16 << 20, 0, [(topic, [(partition, 0, 16 << 20)])]))
            for _topic, parts in response.topics:
                for _partition, error_code, _highwater, *data in parts:
                    assert error_code == 0, f"fetch of {topic}[{partition}] failed with error {error_code}"
                    records = MemoryRecords(data[-1])
                    while (batch := records.next_batch()) is not None:
                        codecs.append(CODECS.get(batch.compression_type, str(batch.compression_type)))
        return codecs
    finally:
        await client.close()
