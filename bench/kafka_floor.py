"""The floor under the proxy's capture stage: Kafka's ack for a burst of the proxy's own events.

The proxy ends every reply only once the broker has its completion event (durable capture). What that
costs at best on this machine is what a bare producer pays for the same thing: :class:`KafkaFloor` writes
the very records the proxy wrote (read back from its completions topic), ``burst`` of them at once, as
``burst`` streams ending together would, through producers set up as the proxy's are (aiokafka,
``acks=all``, idempotent, zstd or the topic's compression as the proxy settles it (``compress``), no linger,
as many producers as ``ROLLWIRE_CAPTURE_PRODUCERS``' default,
each record to the producer its key picks), to a scratch topic. Each record's time from send to ack is
one sample: the capture stage's floor, beside the proxy's own figure in the same run
(:mod:`bench.proxy_overhead`).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from proxy.settings import ProxySettings
from schemas.topics import Topic
from schemas.transport import KafkaSettings
from schemas.transport.producer import DEFAULT_BATCH_BYTES


@dataclass(frozen=True)
class CapturedRecord:
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


async def read_records(kafka: KafkaSettings, want: int, timeout_s: float = 30.0) -> list[CapturedRecord]:
    """Up to ``want`` records of the completions topic of ``kafka``, from its start."""
    consumer = AIOKafkaConsumer(kafka.registry().name(Topic.COMPLETIONS), bootstrap_servers=kafka.kafka_bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                max_partition_fetch_bytes=kafka.fetch_bytes)
    await consumer.start()
    records: list[CapturedRecord] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(records) < want and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records += [CapturedRecord(r.key, r.value, list(r.headers)) for r in batch if r.value is not None]
    finally:
        await consumer.stop()
    return records[:want]


class KafkaFloor:
    """Producers set up as the proxy's, writing bursts of captured records to ``topic``."""

    def __init__(self, kafka: KafkaSettings, topic: str, producers: int | None = None, compress: bool = True) -> None:
        count = producers or ProxySettings.model_fields["capture_producers"].default
        self.topic = topic
        self.compress = compress
        self._producers = [AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap, acks="all",
                                            enable_idempotence=True, compression_type="zstd" if compress else None,
                                            max_request_size=kafka.max_message_bytes, max_batch_size=DEFAULT_BATCH_BYTES,
                                            linger_ms=kafka.kafka_linger_ms) for _ in range(count)]
        self.ack_s: list[float] = []
        self._started = False

    async def start(self) -> None:
        self._started = True
        for producer in self._producers:
            await producer.start()

    async def stop(self) -> None:
        if self._started:
            for producer in self._producers:
                await producer.stop()

    def producer_for(self, key: bytes | None) -> AIOKafkaProducer:
        """The producer a record's key picks (as the proxy's capture picks one)."""
        return self._producers[zlib.crc32(key or b"") % len(self._producers)]

    async def _one(self, record: CapturedRecord) -> float:
        producer = self.producer_for(record.key)
        started = time.perf_counter()
        await producer.send_and_wait(self.topic, record.value, key=record.key, headers=record.headers)
        return time.perf_counter() - started

    async def burst(self, records: list[CapturedRecord]) -> None:
        """Send ``records`` at once; each one's time to its ack is kept in ``ack_s``."""
        self.ack_s += await asyncio.gather(*(self._one(record) for record in records))
