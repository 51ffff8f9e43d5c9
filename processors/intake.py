"""Reading raw records at the worker's door: a cheap envelope check and the dead letter for a bad record.

Completions are 10-50 kB of JSON each; validating every one with pydantic on the way in would cost about
half a millisecond per event, so the worker only checks the envelope here (JSON object, known event type
and schema version, the right topic, ids present, key equal to the session id) and stores the raw bytes.
The full validation happens once, when the session is built; a record that fails it then is
dead-lettered at that point and the session is built without it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import orjson

from schemas.codec import EVENT_TYPES, EventDecodeError
from schemas.dead_letter import DeadLetter
from schemas.topics import TopicSpec


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the worker needs from a record before it stores it."""

    event_type: str
    event_id: str
    session_id: str
    document: dict[str, Any]


def peek(value: bytes | None, key: bytes | None, spec: TopicSpec) -> Envelope:
    """Check a record's envelope; raises EventDecodeError (with the dead letter's error_type) if it is bad."""
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
    supported = model.model_fields["schema_version"].default
    if document.get("schema_version") != supported:
        raise EventDecodeError("unsupported_schema_version", f"{event_type} schema_version "
                               f"{document.get('schema_version')!r}; this consumer reads version {supported}")
    if event_type not in spec.event_types:
        raise EventDecodeError("wrong_topic", f"{event_type} does not belong on {spec.name}")
    event_id, session_id = document.get("event_id"), document.get("session_id")
    if not isinstance(event_id, str) or not event_id:
        raise EventDecodeError("invalid_event", "event_id is missing or not a string")
    if not isinstance(session_id, str) or not session_id:
        raise EventDecodeError("invalid_event", "session_id is missing or not a string")
    if key is not None and key != session_id.encode("utf-8"):
        # Co-partitioning depends on the key: a record keyed otherwise may sit on another session's partition.
        raise EventDecodeError("key_mismatch", f"record key {key[:128]!r} is not the session id {session_id!r}")
    return Envelope(event_type, event_id, session_id, document)


def dead_letter(*, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                headers: Any, group: str, error_type: str, reason: str, max_message_bytes: int) -> DeadLetter:
    """The dead-letter event for a record this worker cannot process (payload cut to fit the size limit)."""
    value = value or b""
    keep = max_message_bytes // 2  # base64 grows it by a third
    pairs = headers.items() if isinstance(headers, dict) else (headers or ())
    return DeadLetter(
        source_topic=topic, partition=partition, offset=offset,
        original_key=base64.b64encode(key).decode("ascii") if key is not None else None,
        consumer_group=group, error_type=error_type, reason=reason[:4000],
        payload=base64.b64encode(value[:keep]).decode("ascii"), payload_bytes=len(value),
        payload_truncated=len(value) > keep,
        headers={k: base64.b64encode(v or b"").decode("ascii") for k, v in pairs})
