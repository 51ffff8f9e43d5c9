"""Typed Kafka clients for rollwire events: settings, an idempotent producer, a deduplicating consumer, and
topic administration (admin.py).

Every service produces, consumes and sets up topics through these, so that keys, headers, compression and
size limits are the same everywhere (see schemas/topics.py for the limits and schemas/codec.py for the
encoding).
"""

from schemas.transport.admin import (
    ExtraTopic,
    KafkaAdmin,
    PartitionState,
    broker_answers,
    cluster_id,
    delete_topics,
    ensure_topics,
)
from schemas.transport.consumer import EventConsumer, RawRecord, Received, topic_spec
from schemas.transport.errors import PublishError, TopicSetupError, TransportError
from schemas.transport.producer import EventProducer
from schemas.transport.settings import KafkaSettings

__all__ = ["EventConsumer", "EventProducer", "ExtraTopic", "KafkaAdmin", "KafkaSettings", "PartitionState",
           "PublishError", "RawRecord", "Received", "TopicSetupError", "TransportError", "broker_answers", "cluster_id",
           "delete_topics", "ensure_topics", "topic_spec"]
