"""Reading raw records at the worker's door: a cheap envelope check (a bad record is dead-lettered with
processors.worker.dead_letters).

Completions are tens of kilobytes of JSON each; validating every one with pydantic on the way in would
cost the worker's loop more than anything else it does per record, so the worker only checks the
envelope here (JSON object, known event type and schema version, the right topic, ids present, key
equal to the session id) and stores the raw bytes.
The full validation happens once, when the session is built; a record that fails it then is
dead-lettered at that point and the session is built without it.

A completion written by rollwire carries its event type and schema version in its headers and its
session id as its key: :func:`completion_session` takes those and does not parse the value at all (a
JSON parse per record is a cost ``bench.pipeline`` shows on the worker's loop). The build's full
validation still checks all of it, the session id against the key included, so a record whose headers
or key lie is dead-lettered then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from schemas.codec import HEADER_EVENT_TYPE, HEADER_SCHEMA_VERSION, EventDecodeError, check_envelope
from schemas.completions import Completion
from schemas.topics import TopicSpec
from schemas.versions import supported_versions


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the worker needs from a record before it stores it."""

    event_type: str
    event_id: str
    session_id: str
    document: dict[str, Any]


def peek(value: bytes | None, key: bytes | None, spec: TopicSpec) -> Envelope:
    """Check a record's envelope; raises EventDecodeError (with the dead letter's error_type) if it is bad."""
    document, _ = check_envelope(value, spec)
    event_type = document["event_type"]
    event_id, session_id = document.get("event_id"), document.get("session_id")
    if not isinstance(event_id, str) or not event_id:
        raise EventDecodeError("invalid_event", "event_id is missing or not a string")
    if not isinstance(session_id, str) or not session_id:
        raise EventDecodeError("invalid_event", "session_id is missing or not a string")
    if key != session_id.encode("utf-8"):
        # Co-partitioning depends on the key: a record keyed otherwise (or not at all, so placed anywhere)
        # may sit on another session's partition, where its session would look for its calls.
        raise EventDecodeError("key_mismatch", f"record key {None if key is None else key[:128]!r} is not the "
                               f"session id {session_id!r}")
    return Envelope(event_type, event_id, session_id, document)


_COMPLETION_TYPE = Completion.model_fields["event_type"].default.encode("ascii")
_COMPLETION_VERSIONS = frozenset(str(v).encode("ascii") for v in supported_versions(Completion))


def completion_session(value: bytes | None, key: bytes | None, headers: Any) -> str | None:
    """The session id of a completion record from its key, when its headers say it is a completion of a
    schema version this worker reads; None when they do not (then :func:`peek` it)."""
    if value is None or not key:
        return None
    kind = version = None
    for name, header in (headers.items() if isinstance(headers, dict) else headers or ()):
        if name == HEADER_EVENT_TYPE:
            kind = header
        elif name == HEADER_SCHEMA_VERSION:
            version = header
    if kind != _COMPLETION_TYPE or version not in _COMPLETION_VERSIONS:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None

