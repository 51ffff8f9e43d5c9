"""The event envelope: what every event on every rollwire topic carries.

Each event type is a pydantic model deriving from :class:`Event`. The envelope fields are filled by the
model itself (a fresh event id, the schema version, the time the fact occurred); the producer stamps
``emitted_at`` when it hands the event to Kafka. Our own events forbid unknown fields, so a typo in a
producer fails loudly instead of writing a field nobody reads. Each model names its topic and the field
that is its partition key, so nothing is ever sent without a key.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from schemas.topics import Topic


def new_event_id() -> str:
    """A fresh, globally unique event id (32 hex characters)."""
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Model(BaseModel):
    """Base for our own (non-provider) models: strict about unknown fields, and numbers finite (JSON has
    no infinity: one would be written as null and the event could not be read back)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class Event(Model):
    """The envelope every event shares.

    Subclasses set ``event_type`` as a ``Literal`` default and ``schema_version`` as a ``Literal`` default,
    and the class variables ``topic`` and ``key_field``.
    """

    topic: ClassVar[Topic]
    key_field: ClassVar[str]

    event_id: str = Field(default_factory=new_event_id, min_length=1, max_length=128,
                          description="Unique id; consumers are idempotent on it.")
    event_type: str
    schema_version: int
    occurred_at: datetime = Field(default_factory=utcnow, description="When the fact happened (UTC).")
    emitted_at: datetime | None = Field(default=None, description="When the producer handed it to Kafka.")
    source: str | None = Field(default=None, max_length=256,
                               description="Which service instance produced it, e.g. 'proxy@host:pid'.")

    def key(self) -> bytes:
        """The record key: the value of this event's key field, UTF-8 encoded."""
        value: Any = getattr(self, self.key_field)
        if not value:
            raise ValueError(f"{type(self).__name__}.{self.key_field} is empty: cannot key the record")
        return str(value).encode("utf-8")
