"""The event producer: idempotent, acks=all, zstd, keyed by each event's own key.

``send`` returns only once the broker has the event (durable capture); ``send_many`` pipelines a batch
and returns when all of them are acknowledged. aiokafka errors surface as :class:`PublishError`.
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

from schemas.codec import encode_event, event_headers
from schemas.envelope import Event, utcnow
from schemas.transport.errors import ClientClosedError, EventTooLargeError, PublishError
from schemas.transport.settings import KafkaSettings

DEFAULT_BATCH_BYTES = 512 * 1024


def default_source(service: str) -> str:
    return f"{service}@{socket.gethostname()}:{os.getpid()}"


class EventProducer:
    """Writes rollwire events to their topics.

    Delivery: ``acks="all"`` with idempotence on, so a retried batch is never written twice; records are
    compressed with zstd. Use as ``async with EventProducer(settings) as producer``.
    """

    def __init__(self, settings: KafkaSettings, *, service: str = "rollwire",
                 transactional_id: str | None = None, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.settings = settings
        self.registry = settings.registry()
        self.source = default_source(service)
        self._producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka_bootstrap,
            client_id=f"{settings.kafka_client_id}-{service}",
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id,
            compression_type="zstd",
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

    def _prepare(self, event: Event) -> tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]:
        if not self._started or self._closed:
            raise ClientClosedError("producer is not running: use `async with EventProducer(...)`")
        stamped = event.model_copy(update={"emitted_at": utcnow(), "source": event.source or self.source})
        value = encode_event(stamped)
        if len(value) > self.settings.max_message_bytes:
            raise EventTooLargeError(
                f"{event.event_type} {event.event_id} is {len(value)} bytes encoded; the limit is "
                f"{self.settings.max_message_bytes} (ROLLWIRE_MAX_MESSAGE_BYTES, broker message.max.bytes)")
        return self.registry.name(event.topic), stamped.key(), value, event_headers(stamped)

    def transaction(self) -> Any:
        """``async with producer.transaction():`` — the sends inside commit together or not at all.

        Needs ``transactional_id``; readers see them only once committed (our consumers read committed).
        """
        if self._transactional_id is None:
            raise ValueError("transactions need EventProducer(..., transactional_id='...')")
        return self._producer.transaction()

    async def send(self, event: Event) -> RecordMetadata:
        """Write one event and wait until the broker has it."""
        topic, key, value, headers = self._prepare(event)
        try:
            return await self._producer.send_and_wait(topic, value, key=key, headers=headers)
        except KafkaError as exc:
            raise PublishError(f"{event.event_type} {event.event_id} not recorded: {exc!r}") from exc

    async def send_many(self, events: Sequence[Event]) -> list[RecordMetadata]:
        """Write several events, pipelined; returns when every one is acknowledged."""
        prepared = [self._prepare(event) for event in events]
        try:
            futures = [await self._producer.send(t, v, key=k, headers=h) for t, k, v, h in prepared]
            return list(await asyncio.gather(*futures))
        except KafkaError as exc:
            raise PublishError(f"batch of {len(events)} events not fully recorded: {exc!r}") from exc
