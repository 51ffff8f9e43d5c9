"""The event consumer: typed records, duplicates dropped by event id, poison records dead-lettered.

Delivery is at least once: offsets are committed only by :meth:`EventConsumer.commit`, which the caller
invokes after it has processed what it received. Redelivered events (same ``event_id``) within the
dedupe window are skipped. A record that cannot be decoded is written to the dead-letter topic (the send
is acknowledged before the consumer moves past it) and the consumer carries on.
"""

from __future__ import annotations

import base64
import logging
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas.codec import EventDecodeError, decode_event
from schemas.dead_letter import DeadLetter
from schemas.envelope import Event
from schemas.topics import Topic
from schemas.transport.errors import ClientClosedError, TransportError
from schemas.transport.producer import EventProducer
from schemas.transport.settings import KafkaSettings

DEFAULT_DEDUPE_WINDOW = 100_000

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    """An event with where it came from."""

    event: Event
    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int


class _SeenIds:
    """A bounded set of recent event ids (oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, event_id: str) -> bool:
        """Remember the id; False if it was already there."""
        if event_id in self._ids:
            self._ids.move_to_end(event_id)
            return False
        self._ids[event_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True


class EventConsumer:
    """Reads rollwire events from one or more topics, as a member of a consumer group or alone.

    ``async for received in consumer`` yields :class:`Received`. Malformed, unknown or misplaced records
    never reach the caller: they go to the dead-letter topic with the reason (or, with
    ``dead_letters=False``, are logged and skipped). Call :meth:`commit` after processing to advance the
    group's offsets.
    """

    def __init__(self, settings: KafkaSettings, topics: Sequence[Topic], *, group_id: str | None,
                 service: str = "rollwire", from_beginning: bool = True,
                 dedupe_window: int = DEFAULT_DEDUPE_WINDOW, dead_letters: bool = True,
                 listener: ConsumerRebalanceListener | None = None) -> None:
        if not topics:
            raise ValueError("EventConsumer needs at least one topic")
        if Topic.DEAD_LETTER in topics and dead_letters:
            raise ValueError("a consumer of the dead-letter topic must not dead-letter (dead_letters=False)")
        self.settings = settings
        self.registry = settings.registry()
        self.group_id = group_id
        self._specs = {self.registry.name(t): self.registry.spec(t) for t in topics}
        self._consumer = AIOKafkaConsumer(
            *self._specs,
            bootstrap_servers=settings.kafka_bootstrap,
            client_id=f"{settings.kafka_client_id}-{service}",
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            isolation_level="read_committed",
            max_partition_fetch_bytes=settings.fetch_bytes,
            fetch_max_bytes=max(settings.fetch_bytes, 50 * 1024 * 1024),
            request_timeout_ms=settings.kafka_request_timeout_ms + 10_000,
        )
        if listener is not None:
            # A group member that tracks its own offsets per partition (the gateway node) hears about
            # assignments and revocations; subscribing again replaces the constructor's subscription.
            self._consumer.subscribe(list(self._specs), listener=listener)
        self._dead_letter_producer = EventProducer(settings, service=f"{service}-dlq") if dead_letters else None
        self._seen = _SeenIds(dedupe_window)
        self._started = False
        self._closed = False
        self.duplicates_skipped = 0
        self.dead_lettered = 0
        self.skipped = 0

    async def start(self) -> None:
        if self._closed:
            raise ClientClosedError("this consumer was stopped; create a new one")
        if self._started:
            return
        try:
            if self._dead_letter_producer is not None:
                await self._dead_letter_producer.start()
            await self._consumer.start()
        except KafkaError as exc:
            await self.stop()
            raise TransportError(f"cannot reach Kafka at {self.settings.kafka_bootstrap}: {exc}") from exc
        self._started = True

    async def stop(self) -> None:
        """Leave the group and close; safe to call twice. Uncommitted records will be redelivered."""
        if self._closed:
            return
        self._closed = True
        await self._consumer.stop()
        if self._dead_letter_producer is not None:
            await self._dead_letter_producer.stop()

    async def __aenter__(self) -> EventConsumer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def __del__(self) -> None:
        if getattr(self, "_started", False) and not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {type(self).__name__}: call stop()", ResourceWarning, stacklevel=1)

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit the offsets of everything received so far (call after processing it), or, with
        ``offsets``, exactly those positions (the next offset to read, per assigned partition)."""
        if self.group_id is None:
            return
        try:
            await self._consumer.commit(dict(offsets) if offsets is not None else None)
        except KafkaError as exc:
            raise TransportError(f"commit failed for group {self.group_id}: {exc!r}") from exc

    async def positions(self) -> dict[TopicPartition, int]:
        """The next offset to be read, per assigned partition: everything before it was handed out or
        dead-lettered (a caller committing per partition may move its commit up to it)."""
        return {tp: await self._consumer.position(tp) for tp in self._consumer.assignment()}

    async def lag(self) -> int:
        """Records between this consumer's positions and the ends of its assigned partitions."""
        partitions = self._consumer.assignment()
        if not partitions:
            return 0
        ends = await self._consumer.end_offsets(list(partitions))
        lag = 0
        for partition in partitions:
            lag += max(0, ends[partition] - await self._consumer.position(partition))
        return lag

    def __aiter__(self) -> AsyncIterator[Received]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Received]:
        while True:
            for received in await self.getmany(timeout_ms=1000):
                yield received

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> list[Received]:
        """Fetch what is available (waiting up to ``timeout_ms``), decoded and deduplicated."""
        if not self._started or self._closed:
            raise ClientClosedError("consumer is not running: use `async with EventConsumer(...)`")
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[Received] = []
        for records in batches.values():
            for record in records:
                received = await self._take(record)
                if received is not None:
                    out.append(received)
        return out

    async def _take(self, record: ConsumerRecord) -> Received | None:
        try:
            event = decode_event(record.value, self._specs.get(record.topic))
        except EventDecodeError as exc:
            await self.dead_letter(record, exc.error_type, exc.reason)
            return None
        if not self._seen.add(event.event_id):
            self.duplicates_skipped += 1
            return None
        return Received(event, record.topic, record.partition, record.offset, record.key, record.timestamp)

    async def dead_letter(self, record: ConsumerRecord, error_type: str, reason: str) -> None:
        """Write a record the caller cannot process to the dead-letter topic, with the reason."""
        if self._dead_letter_producer is None:
            # A reader that is not the record's processor (a registry, a tail) skips it; the processing
            # consumer group dead-letters it once.
            logger.warning("skipping %s@%d/%d (%s: %s)", record.topic, record.partition, record.offset,
                           error_type, reason)
            self.skipped += 1
            return
        value = record.value or b""
        # Base64 grows the payload by a third: keep at most half the size limit so the letter always fits.
        keep = self.settings.max_message_bytes // 2
        letter = DeadLetter(
            source_topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            original_key=base64.b64encode(record.key).decode("ascii") if record.key is not None else None,
            consumer_group=self.group_id,
            error_type=error_type,
            reason=reason[:4000],
            payload=base64.b64encode(value[:keep]).decode("ascii"),
            payload_bytes=len(value),
            payload_truncated=len(value) > keep,
            headers={k: base64.b64encode(v or b"").decode("ascii") for k, v in (record.headers or ())},
        )
        await self._dead_letter_producer.send(letter)
        self.dead_lettered += 1
