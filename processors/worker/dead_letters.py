"""The dead letter a Faust worker writes for a record it cannot process."""

from __future__ import annotations

from typing import Any

from schemas.dead_letter import DeadLetter, dead_letter_of


def dead_letter(*, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                headers: Any, group: str, error_type: str, reason: str, max_message_bytes: int) -> DeadLetter:
    """The dead-letter event for a record this worker cannot process (cut to fit the size limit)."""
    pairs = headers.items() if isinstance(headers, dict) else (headers or ())
    return dead_letter_of(topic=topic, partition=partition, offset=offset, key=key, value=value, headers=pairs,
                          group=group, error_type=error_type, reason=reason, max_message_bytes=max_message_bytes)
