"""Typed Kafka clients for rollwire events: settings, an idempotent producer, a deduplicating consumer.

Every service produces and consumes through these, so that keys, headers, compression and size limits
are the same everywhere (see schemas/topics.py for the limits and schemas/codec.py for the encoding).
"""

from schemas.transport.consumer import EventConsumer, Received
from schemas.transport.errors import PublishError, TransportError
from schemas.transport.producer import EventProducer
from schemas.transport.settings import KafkaSettings

__all__ = ["EventConsumer", "EventProducer", "KafkaSettings", "PublishError", "Received", "TransportError"]
