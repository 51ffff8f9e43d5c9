"""The topic registry: co-partitioning, keys, retention and the prefix."""

from __future__ import annotations

import pytest

from schemas.codec import EVENT_MODELS
from schemas.topics import FRAMING_BYTES, MAX_MESSAGE_BYTES, KeyedBy, Topic, TopicRegistry


def test_session_keyed_topics_are_co_partitioned() -> None:
    registry = TopicRegistry(session_partitions=6, task_partitions=3)
    session_keyed = [s for s in registry.specs() if s.key is KeyedBy.SESSION_ID]
    assert {s.topic for s in session_keyed} == {Topic.SESSIONS, Topic.SESSION_EVENTS, Topic.COMPLETIONS, Topic.CALL_CLAIMS,
                                                Topic.EVALUATIONS, Topic.TRAJECTORIES}
    assert {s.partitions for s in session_keyed} == {6}
    assert registry.spec(Topic.GROUPS).partitions == 3


def test_every_event_model_lives_on_a_topic_that_accepts_it() -> None:
    registry = TopicRegistry()
    for model in EVENT_MODELS:
        spec = registry.spec(model.topic)
        assert model.model_fields["event_type"].default in spec.event_types
        assert model.key_field == spec.key.value or spec.key is KeyedBy.ORIGINAL_KEY


def test_sessions_are_compacted_and_the_log_is_kept() -> None:
    registry = TopicRegistry()
    assert registry.spec(Topic.SESSIONS).configs()["cleanup.policy"] == "compact"
    completions = registry.spec(Topic.COMPLETIONS).configs()
    assert completions["cleanup.policy"] == "delete" and completions["retention.ms"] == "-1"
    assert completions["max.message.bytes"] == str(MAX_MESSAGE_BYTES + FRAMING_BYTES)


def test_prefix_names_topics_and_is_checked() -> None:
    registry = TopicRegistry(prefix="exp7.")
    assert registry.name(Topic.COMPLETIONS) == "exp7.completions"
    assert registry.by_name("exp7.dead-letter").topic is Topic.DEAD_LETTER
    with pytest.raises(KeyError):
        registry.by_name("other.completions")
    with pytest.raises(ValueError, match="characters Kafka refuses"):
        TopicRegistry(prefix="bad prefix/")
    with pytest.raises(ValueError, match="at least 1"):
        TopicRegistry(session_partitions=0)
