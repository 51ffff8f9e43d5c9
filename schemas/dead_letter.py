"""Dead letters: records a consumer could not process, kept with the reason, on `dead-letter`."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import ClassVar, Literal

from pydantic import Field

from schemas.envelope import Event
from schemas.topics import Topic


class DeadLetter(Event):
    """A record a consumer gave up on; the original bytes are kept so that it can be replayed."""

    topic: ClassVar[Topic] = Topic.DEAD_LETTER
    key_field: ClassVar[str] = "original_key"

    event_type: Literal["dead_letter"] = "dead_letter"
    schema_version: Literal[1] = 1
    source_topic: str
    partition: int
    offset: int
    original_key: str | None = Field(default=None, description="The record key (base64).")
    consumer_group: str | None = None
    error_type: str = Field(description="Short class of failure, e.g. 'invalid_json', 'unknown_event_type'.")
    reason: str = Field(max_length=4000)
    payload: str = Field(description="The original record value (base64).")
    payload_bytes: int = Field(ge=0, description="Size of the original value.")
    payload_truncated: bool = Field(default=False, description=(
        "The payload kept here is cut short; the whole record stays at source_topic/partition/offset."))
    headers: dict[str, str] = Field(default_factory=dict, description="Original headers (values base64).")

    def key(self) -> bytes | None:  # type: ignore[override]
        """The original record's key, so that the dead letter lands beside its siblings."""
        return base64.b64decode(self.original_key) if self.original_key is not None else None


# What a dead letter keeps of the record's key and headers: a record is refused for what it carries, and its
# letter must still fit the size limit (a key or header cut short is named in the reason).
_KEY_BYTES = 4096
_HEADER_BYTES = 64 * 1024
_ENVELOPE_BYTES = 32 * 1024  # the letter's own fields (the reason alone may be 16 KB of UTF-8)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def dead_letter_of(*, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                   headers: Iterable[tuple[str, bytes | None]], group: str | None, error_type: str, reason: str,
                   max_message_bytes: int) -> DeadLetter:
    """The dead letter for a record, within ``max_message_bytes`` whatever the record holds: the key and the
    headers are kept up to a bound, and the payload up to what is left (base64 grows each by a third); what
    is cut is said in ``payload_truncated`` and the reason. The whole record stays at its offset."""
    cut: list[str] = []
    if key is not None and len(key) > _KEY_BYTES:
        cut.append(f"key cut to {_KEY_BYTES} of {len(key)} bytes")
        key = key[:_KEY_BYTES]
    kept: dict[str, str] = {}
    room = _HEADER_BYTES
    for name, header in headers:
        data = header or b""
        if len(name) + len(data) > room:
            cut.append(f"header {name[:64]!r} cut")
            data = data[:max(room - len(name), 0)]
        room -= len(name) + len(data)
        kept[name[:_KEY_BYTES]] = _b64(data)
    used = 2 * len(key or b"") * 4 // 3 + sum(len(k) + len(v) for k, v in kept.items()) + _ENVELOPE_BYTES
    keep = max((max_message_bytes - used) * 3 // 4, 0)
    value = value or b""
    if cut:
        reason = f"{reason} ({'; '.join(cut)})"
    return DeadLetter(
        source_topic=topic, partition=partition, offset=offset,
        original_key=_b64(key) if key is not None else None,
        consumer_group=group, error_type=error_type, reason=reason[:4000],
        payload=_b64(value[:keep]), payload_bytes=len(value),
        payload_truncated=len(value) > keep or bool(cut), headers=kept)
