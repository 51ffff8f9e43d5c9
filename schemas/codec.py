"""Encoding events to Kafka record values and back, and the catalogue of every event type.

A record value is the event's JSON (UTF-8, compact). Two headers repeat the envelope's ``event_type`` and
``schema_version`` so that a consumer can route or skip a record without parsing it. Decoding checks,
in order: valid JSON object, a known event type, a supported schema version (any the model reads,
:mod:`schemas.versions`), the model's validation, and
(when the topic is given) that the type belongs on that topic. Each failure is an
:class:`EventDecodeError` with a short ``error_type`` the dead-letter event records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Union

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from schemas.errors import SchemaError
from schemas.call_claims import CallClaim
from schemas.completions import Completion
from schemas.dead_letter import DeadLetter
from schemas.envelope import Event, utcnow
from schemas.evaluations import Evaluation
from schemas.groups import Group
from schemas.policy import ProxyAlive, TierGate, WeightsUpdated
from schemas.sessions import SessionEnded, SessionSpec, SessionStageChanged
from schemas.tasks import TaskAccepted
from schemas.topics import TopicSpec
from schemas.trajectories import Trajectory
from schemas.versions import supported_versions

EVENT_MODELS: tuple[type[Event], ...] = (
    TaskAccepted, SessionSpec, SessionStageChanged, SessionEnded, Completion, CallClaim, Evaluation, Trajectory,
    Group, WeightsUpdated, TierGate, ProxyAlive, DeadLetter,
)
EVENT_TYPES: dict[str, type[Event]] = {
    model.model_fields["event_type"].default: model for model in EVENT_MODELS
}

AnyEvent = Annotated[Union[tuple(EVENT_MODELS)], Field(discriminator="event_type")]  # type: ignore[valid-type]
any_event_adapter: TypeAdapter[Event] = TypeAdapter(AnyEvent)

HEADER_EVENT_TYPE = "rollwire-event-type"
HEADER_SCHEMA_VERSION = "rollwire-schema-version"


class EventDecodeError(SchemaError, ValueError):
    """A record value is not an event this consumer can take."""

    def __init__(self, error_type: str, reason: str) -> None:
        super().__init__(f"{error_type}: {reason}")
        self.error_type = error_type
        self.reason = reason


def encode_event(event: Event) -> bytes:
    """The record value for an event."""
    return event.model_dump_json(exclude_none=True).encode("utf-8")


def event_headers(event: Event) -> list[tuple[str, bytes]]:
    return [
        (HEADER_EVENT_TYPE, event.event_type.encode("ascii")),
        (HEADER_SCHEMA_VERSION, str(event.schema_version).encode("ascii")),
    ]


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """An event stamped for sending and encoded as one Kafka record: what every writer hands its client."""

    event: Event
    """The stamped event (``emitted_at`` now, ``source`` filled in)."""
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


def stamp(event: Event, source: str) -> Event:
    """The event as it leaves its writer: ``emitted_at`` set to now, ``source`` kept or set to ``source``."""
    return event.model_copy(update={"emitted_at": utcnow(), "source": event.source or source})


def encode_record(event: Event, source: str) -> EncodedRecord:
    """Stamp and encode an event: the one way every writer (the typed producer, the Faust workers, the
    rebuild) turns an event into a record, so that keys, headers and stamps never differ between them."""
    stamped = stamp(event, source)
    return EncodedRecord(stamped, stamped.key(), encode_event(stamped), event_headers(stamped))


def check_envelope(value: bytes | None, topic: TopicSpec | None = None) -> tuple[dict[str, Any], type[Event]]:
    """The record's JSON document and its event model, after the envelope checks (JSON object, known
    event type, supported schema version, right topic) but before validating the body; raises
    EventDecodeError saying what is wrong. Cheap: for consumers that look at the envelope first."""
    if value is None:
        raise EventDecodeError("empty_value", "record has no value (tombstone or null)")
    try:
        document = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError("invalid_json", f"record value is not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise EventDecodeError("invalid_event", f"record value is a JSON {type(document).__name__}, not an object")
    event_type = document.get("event_type")
    model = EVENT_TYPES.get(event_type) if isinstance(event_type, str) else None
    if model is None:
        raise EventDecodeError("unknown_event_type", f"event_type {event_type!r} is not one of {sorted(EVENT_TYPES)}")
    version = document.get("schema_version")
    versions = supported_versions(model)
    if not isinstance(version, int) or version not in versions:
        raise EventDecodeError("unsupported_schema_version",
                               f"{event_type} schema_version {version!r}; this consumer reads "
                               f"version {' or '.join(map(str, sorted(versions)))} (see schemas/versions.py)")
    if topic is not None and event_type not in topic.event_types:
        raise EventDecodeError("wrong_topic", f"{event_type} does not belong on {topic.name}")
    return document, model


def decode_event(value: bytes | None, topic: TopicSpec | None = None) -> Event:
    """Parse and validate a record value; raises EventDecodeError saying what is wrong."""
    document, model = check_envelope(value, topic)
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise EventDecodeError("invalid_event", _summarize(exc)) from exc


def _summarize(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for error in exc.errors()[:limit]:
        where = ".".join(str(p) for p in error["loc"]) or "(root)"
        parts.append(f"{where}: {error['msg']}")
    more = f" (+{exc.error_count() - limit} more)" if exc.error_count() > limit else ""
    return f"{exc.title} failed validation: " + "; ".join(parts) + more


def unreadable_reason(event: Event) -> str | None:
    """Why ``event`` could not be read back once written (say an integer past 64 bits in a free-form
    field, which no consumer's JSON decoder takes), or None when its encoding decodes. For the APIs that
    accept a session or a task: refusing one there is a 422; accepting it would lose it on the log."""
    try:
        decode_event(encode_event(event))
    except EventDecodeError as exc:
        return exc.reason
    except ValueError as exc:  # a string that is not valid Unicode (a lone surrogate) cannot be encoded
        return str(exc)
    return None


def event_to_jsonable(event: Event) -> dict[str, Any]:
    """The event as plain JSON types (packed arrays as strings)."""
    return event.model_dump(mode="json", exclude_none=True)
