"""The event consumer: typed records, duplicates dropped by event id, poison records dead-lettered.

Delivery is at least once: offsets are committed only by :meth:`EventConsumer.commit`, which the caller
invokes after it has processed what it received. Redelivered events (same ``event_id``) within the
dedupe window are skipped. A record that cannot be decoded is written to the dead-letter topic (the send
is acknowledged before the consumer moves past it) and the consumer carries on.

Readers that are not a group member position themselves: a consumer without a group is assigned every
partition of its topics (:meth:`EventConsumer.wait_for_assignment`), and one made with ``manual=True``
takes only the partitions it is given (:meth:`EventConsumer.assign`); both seek (to the beginning, to a
time, to an offset), compare their positions with the ends of the log (:meth:`EventConsumer.caught_up`),
and may read records undecoded (:meth:`EventConsumer.getmany_raw`, :meth:`EventConsumer.read_values`)
where decoding every record would cost more than it tells.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas.codec import EventDecodeError, decode_event
from schemas.dead_letter import dead_letter_of
from schemas.envelope import Event
from schemas.topics import Topic, TopicSpec
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


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A record as the broker holds it, not decoded: for readers that look at keys and headers, or filter
    the bytes, before (or instead of) decoding."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int

    @classmethod
    def of(cls, record: ConsumerRecord) -> RawRecord:
        return cls(record.topic, record.partition, record.offset, record.key, record.value,
                   tuple(record.headers or ()), record.timestamp)


def topic_spec(settings: KafkaSettings, name: str, like: Topic) -> TopicSpec:
    """The spec of a topic given by its full name: the registry's when it is one of the deployment's
    topics, else ``like``'s spec under that name (a rebuild's output topic holds what ``trajectories`` does)."""
    registry = settings.registry()
    try:
        return registry.by_name(name)
    except (KeyError, ValueError):
        return replace(registry.spec(like), name=name)


def _expected_key(event: Event) -> bytes | None:
    try:
        return event.key()
    except ValueError:  # no key value: such an event is never written keyed
        return None


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

    ``topics`` are registry topics, or a :class:`~schemas.topics.TopicSpec` for a topic under another name
    (a rebuild's output topic, a trainer's own groups topic): the spec's event types are what may be on it.
    ``manual=True``: no subscription, the caller assigns partitions (``group_id`` must be None).
    ``read_committed=False`` also reads records of transactions still open. ``max_poll_interval_s``: how
    long a group member may take between two reads before the group gives its partitions away.
    ``dedupe_window=0`` hands out every copy of an event (for a reader that keeps one copy per id itself).
    """

    def __init__(self, settings: KafkaSettings, topics: Sequence[Topic | TopicSpec], *, group_id: str | None,
                 service: str = "rollwire", from_beginning: bool = True,
                 dedupe_window: int = DEFAULT_DEDUPE_WINDOW, dead_letters: bool = True,
                 listener: ConsumerRebalanceListener | None = None, manual: bool = False,
                 read_committed: bool = True, max_poll_interval_s: float | None = None) -> None:
        if not topics:
            raise ValueError("EventConsumer needs at least one topic")
        self.settings = settings
        self.registry = settings.registry()
        self.group_id = group_id
        specs = [t if isinstance(t, TopicSpec) else self.registry.spec(t) for t in topics]
        if dead_letters and any(spec.topic == Topic.DEAD_LETTER for spec in specs):
            raise ValueError("a consumer of the dead-letter topic must not dead-letter (dead_letters=False)")
        if manual and (group_id is not None or listener is not None):
            raise ValueError("a manually assigned consumer has no group: pass group_id=None and no listener")
        self._specs = {spec.name: spec for spec in specs}
        options: dict[str, int] = {}
        if max_poll_interval_s is not None:
            options["max_poll_interval_ms"] = int(max_poll_interval_s * 1000)
        self._consumer = AIOKafkaConsumer(
            *(() if manual else self._specs),
            bootstrap_servers=settings.kafka_bootstrap,
            client_id=f"{settings.kafka_client_id}-{service}",
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            isolation_level="read_committed" if read_committed else "read_uncommitted",
            max_partition_fetch_bytes=settings.fetch_bytes,
            fetch_max_bytes=max(settings.fetch_bytes, 50 * 1024 * 1024),
            request_timeout_ms=settings.kafka_request_timeout_ms + 10_000,
            **options,
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
        try:
            return {tp: await self._consumer.position(tp) for tp in self._consumer.assignment()}
        except KafkaError as exc:
            raise TransportError(f"positions on {self.topic_names}: {exc!r}") from exc

    async def lag(self) -> int:
        """Records between this consumer's positions and the ends of its assigned partitions."""
        partitions = self._consumer.assignment()
        if not partitions:
            return 0
        try:
            ends = await self._consumer.end_offsets(list(partitions))
            lag = 0
            for partition in partitions:
                lag += max(0, ends[partition] - await self._consumer.position(partition))
        except KafkaError as exc:
            raise TransportError(f"lag on {self.topic_names}: {exc!r}") from exc
        return lag

    # -- where the consumer reads ---------------------------------------------------------------------

    @property
    def topic_names(self) -> list[str]:
        """The full names of the topics this consumer reads."""
        return list(self._specs)

    def assignment(self) -> set[TopicPartition]:
        """The partitions this consumer reads now (a group member's may be empty while it joins)."""
        return set(self._consumer.assignment())

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """A ``manual=True`` consumer reads exactly these partitions (replacing what it read before)."""
        partitions = list(partitions)
        unknown = {tp.topic for tp in partitions} - set(self._specs)
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not this consumer's topics ({self.topic_names})")
        self._consumer.assign(partitions)

    async def wait_for_assignment(self, timeout_s: float = 30.0) -> list[TopicPartition]:
        """The assigned partitions, in order, once there are some: a consumer without a group is assigned
        every partition of its topics as soon as it has their metadata. TransportError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._consumer.assignment():
            if time.monotonic() > deadline:
                raise TransportError(f"no partitions of {self.topic_names} assigned within {timeout_s:g} s; do the "
                                     f"topics exist on {self.settings.kafka_bootstrap}?")
            await asyncio.sleep(0.05)
        return sorted(self._consumer.assignment(), key=lambda tp: (tp.topic, tp.partition))

    def seek(self, partition: TopicPartition, offset: int) -> None:
        """Read ``partition`` from ``offset`` on (it must be assigned)."""
        self._consumer.seek(partition, offset)

    async def position(self, partition: TopicPartition) -> int:
        """The offset of the next record this consumer will read from ``partition`` (it must be assigned)."""
        try:
            return int(await self._consumer.position(partition))
        except KafkaError as exc:
            raise TransportError(f"position on {partition}: {exc!r}") from exc

    async def seek_to_beginning(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        """Read the given (default: every assigned) partition from its oldest retained record."""
        try:
            await self._consumer.seek_to_beginning(*(partitions or ()))
        except KafkaError as exc:
            raise TransportError(f"seeking {self.topic_names} to the beginning: {exc!r}") from exc

    async def seek_to_time(self, timestamp_ms: int, partitions: Iterable[TopicPartition] | None = None) -> None:
        """Read each given (default: assigned) partition from its first record at or after ``timestamp_ms``;
        a partition without one reads what comes next: from its end as it was before the search, so that a
        record written during the search is never skipped."""
        targets = list(partitions) if partitions is not None else sorted(self.assignment())
        try:
            ends = await self._consumer.end_offsets(targets)
            found = await self._consumer.offsets_for_times({tp: timestamp_ms for tp in targets})
            for tp in targets:
                at = found.get(tp)
                self._consumer.seek(tp, ends[tp] if at is None else at.offset)
        except KafkaError as exc:
            raise TransportError(f"seeking {self.topic_names} to {timestamp_ms} ms: {exc!r}") from exc

    async def beginning_offsets(self,
                                partitions: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """The oldest retained offset of each given (default: assigned) partition."""
        targets = list(partitions) if partitions is not None else list(self.assignment())
        if not targets:
            return {}
        try:
            return dict(await self._consumer.beginning_offsets(targets))
        except KafkaError as exc:
            raise TransportError(f"beginning offsets of {self.topic_names}: {exc!r}") from exc

    async def end_offsets(self, partitions: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """The offset the next record will get, per given (default: assigned) partition: the log's end now."""
        targets = list(partitions) if partitions is not None else list(self.assignment())
        if not targets:
            return {}
        try:
            return dict(await self._consumer.end_offsets(targets))
        except KafkaError as exc:
            raise TransportError(f"end offsets of {self.topic_names}: {exc!r}") from exc

    async def caught_up(self, ends: Mapping[TopicPartition, int]) -> bool:
        """Whether this consumer has read every partition in ``ends`` up to its offset there (ends taken
        earlier with :meth:`end_offsets`: "has it read what was on the log then")."""
        try:
            for tp, end in ends.items():
                if await self._consumer.position(tp) < end:
                    return False
        except KafkaError as exc:
            raise TransportError(f"positions on {self.topic_names}: {exc!r}") from exc
        return True

    # -- reading -------------------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Received]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Received]:
        while True:
            for received in await self.getmany(timeout_ms=1000):
                yield received

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> list[Received]:
        """Fetch what is available (waiting up to ``timeout_ms``), decoded and deduplicated."""
        out: list[Received] = []
        for record in await self.getmany_raw(timeout_ms, max_records):
            received = await self.take(record)
            if received is not None:
                out.append(received)
        return out

    async def getmany_raw(self, timeout_ms: int = 0, max_records: int | None = None,
                          partitions: Iterable[TopicPartition] = ()) -> list[RawRecord]:
        """Fetch what is available from the given (default: every assigned) partition, not decoded: no
        dead letters, no deduplication (:meth:`take` decodes one as :meth:`getmany` would)."""
        if not self._started or self._closed:
            raise ClientClosedError("consumer is not running: use `async with EventConsumer(...)`")
        try:
            batches = await self._consumer.getmany(*partitions, timeout_ms=timeout_ms, max_records=max_records)
        except KafkaError as exc:
            raise TransportError(f"reading {self.topic_names} failed: {exc!r}") from exc
        return [RawRecord.of(record) for records in batches.values() for record in records]

    async def read_values(self, partition: int, offsets: Iterable[int], *,
                          timeout_s: float = 30.0) -> dict[int, bytes]:
        """A ``manual=True`` consumer of one topic: the values at ``offsets`` of ``partition``, undecoded;
        offsets not in the log (no longer, or not yet) are absent. Reassigns the consumer to that partition."""
        wanted = set(offsets)
        found: dict[int, bytes] = {}
        if not wanted:
            return found
        if len(self._specs) != 1:
            raise ValueError(f"read_values needs a consumer of one topic, not of {self.topic_names}")
        tp = TopicPartition(self.topic_names[0], partition)
        self.assign([tp])
        start = (await self.beginning_offsets([tp]))[tp]
        end = (await self.end_offsets([tp]))[tp]
        wanted = {o for o in wanted if start <= o < end}
        if not wanted:
            return found
        self.seek(tp, min(wanted))
        last = max(wanted)
        deadline = time.monotonic() + timeout_s
        while wanted.difference(found) and time.monotonic() < deadline:
            for record in await self.getmany_raw(500, partitions=[tp]):
                if record.offset in wanted and record.value is not None:
                    found[record.offset] = record.value
            if await self.caught_up({tp: last + 1}):
                break
        return found

    async def take(self, record: RawRecord) -> Received | None:
        """Decode a record read with :meth:`getmany_raw` as :meth:`getmany` would: None for a duplicate or a
        record that is not an event for its topic (dead-lettered, or skipped with ``dead_letters=False``)."""
        try:
            event = decode_event(record.value, self._specs.get(record.topic))
        except EventDecodeError as exc:
            await self.dead_letter(record, exc.error_type, exc.reason)
            return None
        if record.key != _expected_key(event):
            # A record filed under one session (or task) that names another: taking it would let one
            # session's writer act on the other's data.
            await self.dead_letter(record, "key_mismatch", f"record key {record.key!r} but the event's "
                                   f"{event.key_field} is {getattr(event, event.key_field)!r}")
            return None
        # Duplicates by key and id: an event id is the writer's to choose, and one session's must never
        # hide another's record.
        if not self._seen.add(f"{(record.key or b'').hex()}:{event.event_id}"):
            self.duplicates_skipped += 1
            return None
        return Received(event, record.topic, record.partition, record.offset, record.key, record.timestamp_ms)

    async def dead_letter(self, record: RawRecord, error_type: str, reason: str) -> None:
        """Write a record the caller cannot process to the dead-letter topic, with the reason."""
        if self._dead_letter_producer is None:
            # A reader that is not the record's processor (a registry, a tail) skips it; the processing
            # consumer group dead-letters it once.
            logger.warning("skipping %s@%d/%d (%s: %s)", record.topic, record.partition, record.offset,
                           error_type, reason)
            self.skipped += 1
            return
        letter = dead_letter_of(topic=record.topic, partition=record.partition, offset=record.offset,
                                key=record.key, value=record.value, headers=record.headers or (),
                                group=self.group_id, error_type=error_type, reason=reason,
                                max_message_bytes=self.settings.max_message_bytes)
        await self._dead_letter_producer.send(letter)
        self.dead_lettered += 1
