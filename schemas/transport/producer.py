"""The event producer: idempotent, acks=all, zstd (or the topic's compression), keyed by each event's own key.

``send`` returns only once the broker has the event (durable capture); ``send_many`` pipelines a batch
and returns when all of them are acknowledged. aiokafka errors surface as :class:`PublishError`. Every
event is stamped and encoded by :func:`schemas.codec.encode_record`; it goes to its registry topic, or to
the topic named by ``to=`` (a topic outside the registry, such as a rebuild's output topic).
"""

from __future__ import annotations

import asyncio
import os
import socket
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from schemas.codec import EncodedRecord, encode_record
from schemas.envelope import Event
from schemas.transport.errors import ClientClosedError, EventTooLargeError, PublishError
from schemas.transport.settings import KafkaSettings

DEFAULT_BATCH_BYTES = 512 * 1024


def default_source(service: str) -> str:
    return f"{service}@{socket.gethostname()}:{os.getpid()}"


class EventProducer:
    """Writes rollwire events to their topics.

    Delivery: ``acks="all"`` with idempotence on, so a retried batch is never written twice. Batches are
    compressed with zstd here, or with ``compress=False`` sent as they are for the broker to compress
    (the proxy's topics compress with zstd: schemas.topics.BROKER_COMPRESSION). Use as
    ``async with EventProducer(settings) as producer``.
    """

    def __init__(self, settings: KafkaSettings, *, service: str = "rollwire",
                 transactional_id: str | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 compress: bool = True) -> None:
        self.settings = settings
        self.registry = settings.registry()
        self.source = default_source(service)
        self._producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka_bootstrap,
            client_id=f"{settings.kafka_client_id}-{service}",
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id,
            compression_type="zstd" if compress else None,
            max_request_size=settings.max_message_bytes,
            max_batch_size=batch_bytes,
            linger_ms=settings.kafka_linger_ms,
            request_timeout_ms=settings.kafka_request_timeout_ms,
        )
        self._transactional_id = transactional_id
        self._started = False
        self._closed = False

    async def start(self) -> None:
        if self._closed:
            raise ClientClosedError("this producer was stopped; create a new one")
        if self._started:
            return
        try:
            await self._producer.start()
        except KafkaError as exc:
            await self._producer.stop()
            raise PublishError(f"cannot reach Kafka at {self.settings.kafka_bootstrap}: {exc}") from exc
        self._started = True

    async def stop(self) -> None:
        """Flush what is pending and close; safe to call twice."""
        if self._started and not self._closed:
            await self._producer.stop()
        self._closed = True

    async def __aenter__(self) -> EventProducer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def __del__(self) -> None:
        if getattr(self, "_started", False) and not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {type(self).__name__}: call stop()", ResourceWarning, stacklevel=1)

    def _prepare(self, event: Event, to: str | None) -> tuple[str, EncodedRecord]:
        if not self._started or self._closed:
            raise ClientClosedError("producer is not running: use `async with EventProducer(...)`")
        record = encode_record(event, self.source)
        if len(record.value) > self.settings.max_message_bytes:
            raise EventTooLargeError(
                f"{event.event_type} {event.event_id} is {len(record.value)} bytes encoded; the limit is "
                f"{self.settings.max_message_bytes} (ROLLWIRE_MAX_MESSAGE_BYTES, broker message.max.bytes)")
        return to or self.registry.name(event.topic), record

    def transaction(self) -> Any:
        """``async with producer.transaction():`` — the sends inside commit together or not at all.

        Needs ``transactional_id``; readers see them only once committed (our consumers read committed).
        """
        if self._transactional_id is None:
            raise ValueError("transactions need EventProducer(..., transactional_id='...')")
        return self._producer.transaction()

    async def send(self, event: Event, *, to: str | None = None) -> RecordMetadata:
        """Write one event (to its registry topic, or to the topic ``to``) and wait until the broker has it."""
        topic, record = self._prepare(event, to)
        try:
            return await self._producer.send_and_wait(topic, record.value, key=record.key, headers=record.headers)
        except KafkaError as exc:
            raise PublishError(f"{event.event_type} {event.event_id} not recorded: {exc!r}") from exc

    async def send_many(self, events: Sequence[Event], *, to: str | None = None) -> list[RecordMetadata]:
        """Write several events (each to its registry topic, or all to the topic ``to``), pipelined;
        returns when every one is acknowledged."""
        prepared = [self._prepare(event, to) for event in events]
        try:
            futures = [await self._producer.send(topic, r.value, key=r.key, headers=r.headers)
                       for topic, r in prepared]
            return list(await asyncio.gather(*futures))
        except KafkaError as exc:
            raise PublishError(f"batch of {len(events)} events not fully recorded: {exc!r}") from exc
