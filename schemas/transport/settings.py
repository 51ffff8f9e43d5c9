"""Kafka connection settings, read from the environment (``ROLLWIRE_*``) with the embedded defaults."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator
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

    A replicated deployment sets ``ROLLWIRE_REPLICATION_FACTOR=3`` and ``ROLLWIRE_MIN_INSYNC_REPLICAS=2`` for
    every service (the topics they create get both; with the producers' ``acks=all`` an acknowledged event is
    then on two brokers at least, and a partition down to one in-sync replica refuses writes rather than
    keeping the only copy), and keeps ``unclean.leader.election.enable=false`` on the brokers (Kafka's
    default; the topics set it too), so that a replica that missed acknowledged writes never becomes leader.
    ``rollwire up --brokers 3`` sets all of them.
    """

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_", extra="ignore")

    kafka_bootstrap: str = Field(default="127.0.0.1:19092", description=(
        "The brokers to use, host:port[,host:port...]; when it names another cluster, `rollwire up` starts none."))
    topic_prefix: str = Field(default=DEFAULT_PREFIX, description="Prefix of every topic name.")
    session_partitions: int = Field(default=DEFAULT_SESSION_PARTITIONS, ge=1, description=(
        "Partitions of the session-keyed topics (all the same, so that the workers co-partition them)."))
    task_partitions: int = Field(default=DEFAULT_TASK_PARTITIONS, ge=1, description=(
        "Partitions of the task-keyed topics."))
    max_message_bytes: int = Field(default=MAX_MESSAGE_BYTES, ge=1024 * 1024, description=(
        "The largest event, enforced alike by the producers, the topics, the consumers and the project's broker."))
    kafka_client_id: str = Field(default="rollwire", description="Client id the Kafka clients send.")
    # No linger by default: the proxy waits for the ack of each completion before a harness sees the end of
    # its reply, and aiokafka keeps one produce request per broker in flight, so under load records batch
    # by themselves while the previous request is out; a linger would only add its time to every reply.
    kafka_linger_ms: int = Field(default=0, ge=0, description="Producer linger in milliseconds.")
    kafka_request_timeout_ms: int = Field(default=30_000, ge=1000, description=(
        "Longest wait for one Kafka request."))
    replication_factor: int = Field(default=1, ge=1, le=16, description=(
        "Replicas of every topic and table changelog rollwire creates; 3 on a cluster of several brokers."))
    min_insync_replicas: int = Field(default=1, ge=1, le=16, description=(
        "How many replicas must have a write before it is acknowledged (topic min.insync.replicas); 2 on a "
        "cluster of several brokers."))

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_has_port(cls, value: str) -> str:
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"ROLLWIRE_KAFKA_BOOTSTRAP entry {server!r} must be host:port")
        return value

    @model_validator(mode="after")
    def _isr_fits_replicas(self) -> KafkaSettings:
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(f"ROLLWIRE_MIN_INSYNC_REPLICAS={self.min_insync_replicas} exceeds "
                             f"ROLLWIRE_REPLICATION_FACTOR={self.replication_factor}: no write could be "
                             "acknowledged; set it to at most the replication factor (2 of 3 is usual)")
        return self

    def registry(self) -> TopicRegistry:
        return TopicRegistry(self.topic_prefix, self.session_partitions, self.task_partitions)

    @property
    def fetch_bytes(self) -> int:
        """Consumer per-partition fetch size: one largest record plus its framing."""
        return self.max_message_bytes + FRAMING_BYTES
