"""Fixtures of the transport tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from schemas.transport import KafkaSettings
from schemas.transport.admin import delete_topics


@pytest.fixture
async def settings(kafka_bootstrap: str) -> AsyncIterator[KafkaSettings]:
    """Settings under a fresh prefix whose topics do not exist yet (deleted afterwards)."""
    fresh = KafkaSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=f"adm{uuid.uuid4().hex[:10]}.",
                          session_partitions=3, task_partitions=2)
    yield fresh
    await delete_topics(kafka_bootstrap, fresh.topic_prefix)
