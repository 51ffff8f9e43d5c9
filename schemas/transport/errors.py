"""Exceptions raised at the Kafka boundary; aiokafka's own errors are translated into these."""

from schemas.errors import SchemaError


class TransportError(SchemaError):
    """Base class for failures talking to Kafka."""


class PublishError(TransportError):
    """An event could not be written to the broker (it is not recorded)."""


class EventTooLargeError(PublishError):
    """An encoded event exceeds the configured message size limit."""


class ClientClosedError(TransportError):
    """The client was used before start() or after stop()."""


class TopicSetupError(TransportError):
    """Topics could not be created, checked or deleted, or an existing topic disagrees with the registry."""
