"""Kafka connection settings, read from the environment (``ROLLWIRE_*``) with the embedded defaults."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.topics import (
    DEFAULT_PREFIX,
    DEFAULT_SESSION_PARTITIONS,
    DEFAULT_TASK_PARTITIONS,
    FRAMING_BYTES,
    MAX_MESSAGE_BYTES,
    TopicRegistry,
)


class KafkaSettings(BaseSettings):
    """Where the broker is and how topics are named. Every field reads ``ROLLWIRE_<FIELD>``.

    ``ROLLWIRE_KAFKA_BOOTSTRAP`` (default ``127.0.0.1:19092``, the project's local broker),
    ``ROLLWIRE_TOPIC_PREFIX`` (``rollwire.``), ``ROLLWIRE_SESSION_PARTITIONS`` (8),
    ``ROLLWIRE_TASK_PARTITIONS`` (4), ``ROLLWIRE_MAX_MESSAGE_BYTES`` (8 MiB),
    ``ROLLWIRE_KAFKA_CLIENT_ID`` (``rollwire``), ``ROLLWIRE_KAFKA_LINGER_MS`` (2),
    ``ROLLWIRE_KAFKA_REQUEST_TIMEOUT_MS`` (30000).
    """

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_", extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:19092"
    topic_prefix: str = DEFAULT_PREFIX
    session_partitions: int = Field(default=DEFAULT_SESSION_PARTITIONS, ge=1)
    task_partitions: int = Field(default=DEFAULT_TASK_PARTITIONS, ge=1)
    max_message_bytes: int = Field(default=MAX_MESSAGE_BYTES, ge=1024 * 1024)
    kafka_client_id: str = "rollwire"
    # No linger by default: the proxy waits for the ack of each completion before a harness sees the end of
    # its reply, and aiokafka keeps one produce request per broker in flight, so under load records batch
    # by themselves while the previous request is out; a linger would only add its time to every reply.
    kafka_linger_ms: int = Field(default=0, ge=0)
    kafka_request_timeout_ms: int = Field(default=30_000, ge=1000)

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_has_port(cls, value: str) -> str:
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"ROLLWIRE_KAFKA_BOOTSTRAP entry {server!r} must be host:port")
        return value

    def registry(self) -> TopicRegistry:
        return TopicRegistry(self.topic_prefix, self.session_partitions, self.task_partitions)

    @property
    def fetch_bytes(self) -> int:
        """Consumer per-partition fetch size: one largest record plus its framing."""
        return self.max_message_bytes + FRAMING_BYTES
