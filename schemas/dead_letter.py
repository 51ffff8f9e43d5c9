"""Dead letters: records a consumer could not process, kept with the reason, on `dead-letter`."""

from __future__ import annotations

import base64
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
