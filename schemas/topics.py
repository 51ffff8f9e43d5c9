"""The topic registry: every Kafka topic rollwire uses, its key, partitions, retention and size limits.

Everything that creates, produces to or consumes from a topic reads it from here, so that the broker,
the producers and the consumers agree on names, keys and limits. Session-keyed topics share one
partition count so that Faust can co-partition them (a session's completions, lifecycle events,
evaluations and trajectories land on the same partition number).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# One record may be a whole 200,000-token completion event. 8 MiB is the limit everywhere: the broker's
# message.max.bytes, each topic's max.message.bytes, the producer's max_request_size and the consumer's
# fetch sizes are all derived from this one number (see schemas.transport.KafkaSettings).
MAX_MESSAGE_BYTES: int = 8 * 1024 * 1024
# Record batch and request framing on top of the largest record: every limit that applies to a batch
# (a topic's max.message.bytes, the broker's, the consumer's fetch sizes) leaves this much room, so that
# a record of exactly MAX_MESSAGE_BYTES still fits.
FRAMING_BYTES: int = 64 * 1024
# The compression.type of the topics the proxy writes (completions, and the specs of ad-hoc sessions):
# the broker compresses the batches the proxy sends uncompressed, off the proxy's event loop, and keeps
# batches that arrive as zstd as they are (proxy.settings capture_compression). Every other topic keeps
# its producers' batches as they come ("producer"): those compress their own (zstd, the workers snappy),
# and a broker would recompress a snappy batch on a zstd topic. Topics created before this say
# "producer" everywhere; the proxy then compresses itself.
BROKER_COMPRESSION: str = "zstd"

DEFAULT_PREFIX: str = "rollwire."
DEFAULT_SESSION_PARTITIONS: int = 8
DEFAULT_TASK_PARTITIONS: int = 4

_WEEK_MS = 7 * 24 * 3600 * 1000


class Topic(str, enum.Enum):
    """Logical topic names, without the deployment's prefix."""

    TASKS = "tasks"
    SESSIONS = "sessions"
    SESSION_EVENTS = "session-events"
    COMPLETIONS = "completions"
    CALL_CLAIMS = "call-claims"
    EVALUATIONS = "evaluations"
    TRAJECTORIES = "trajectories"
    GROUPS = "groups"
    POLICY = "policy"
    DEAD_LETTER = "dead-letter"


class KeyedBy(str, enum.Enum):
    """Which identifier is the record key (and so decides the partition)."""

    TASK_ID = "task_id"
    SESSION_ID = "session_id"
    SERVED_MODEL = "served_model"
    ORIGINAL_KEY = "original_key"


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic as the broker should hold it."""

    topic: Topic
    name: str
    key: KeyedBy
    partitions: int
    compacted: bool = False
    retention_ms: int = -1
    event_types: frozenset[str] = field(default_factory=frozenset)
    """Event types allowed on this topic; anything else is dead-lettered by consumers."""
    compression: str = "producer"
    """Its compression.type: ``producer`` (batches kept as they come) or BROKER_COMPRESSION."""

    def configs(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, str]:
        """Topic-level broker configs (strings, as the admin API wants them)."""
        configs = {
            # The topic's limit applies to whole batches, so it leaves room for their framing.
            "max.message.bytes": str(max_message_bytes + FRAMING_BYTES),
            "cleanup.policy": "compact" if self.compacted else "delete",
            "retention.ms": str(self.retention_ms),
            "compression.type": self.compression,
        }
        return configs


@dataclass(frozen=True, slots=True)
class TopicRegistry:
    """The deployment's topics, resolved with its prefix and partition counts."""

    prefix: str = DEFAULT_PREFIX
    session_partitions: int = DEFAULT_SESSION_PARTITIONS
    task_partitions: int = DEFAULT_TASK_PARTITIONS

    def __post_init__(self) -> None:
        if self.session_partitions < 1 or self.task_partitions < 1:
            raise ValueError("partition counts must be at least 1: set ROLLWIRE_SESSION_PARTITIONS / "
                             "ROLLWIRE_TASK_PARTITIONS to a positive number")
        bad = set(self.prefix) - set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
        if bad:
            raise ValueError(f"topic prefix {self.prefix!r} has characters Kafka refuses: {sorted(bad)}; "
                             "use letters, digits, '.', '_' and '-'")

    def specs(self) -> list[TopicSpec]:
        """Every topic, in the order DESIGN.md lists them."""
        return [self.spec(topic) for topic in Topic]

    def spec(self, topic: Topic) -> TopicSpec:
        s, t = self.session_partitions, self.task_partitions
        name = self.prefix + topic.value
        match topic:
            case Topic.TASKS:
                return TopicSpec(topic, name, KeyedBy.TASK_ID, t, retention_ms=-1,
                                 event_types=frozenset({"task.accepted"}))
            case Topic.SESSIONS:
                # Compacted: the latest spec per session is the registry the proxy reads.
                return TopicSpec(topic, name, KeyedBy.SESSION_ID, s, compacted=True,
                                 event_types=frozenset({"session.spec"}), compression=BROKER_COMPRESSION)
            case Topic.SESSION_EVENTS:
                return TopicSpec(topic, name, KeyedBy.SESSION_ID, s, retention_ms=-1,
                                 event_types=frozenset({"session.stage", "session.ended"}))
            case Topic.COMPLETIONS:
                # Kept forever by default: the completion log is the source every view is rebuilt from.
                return TopicSpec(topic, name, KeyedBy.SESSION_ID, s, retention_ms=-1,
                                 event_types=frozenset({"completion"}), compression=BROKER_COMPRESSION)
            case Topic.CALL_CLAIMS:
                # One small record per model call, read by every proxy process: a week covers any live session.
                return TopicSpec(topic, name, KeyedBy.SESSION_ID, s, retention_ms=_WEEK_MS,
                                 event_types=frozenset({"call.claimed"}))
            case Topic.EVALUATIONS:
                return TopicSpec(topic, name, KeyedBy.SESSION_ID, s, retention_ms=-1,
                                 event_types=frozenset({"evaluation"}))
            case Topic.TRAJECTORIES:
                return TopicSpec(topic, name, KeyedBy.SESSION_ID, s, retention_ms=-1,
                                 event_types=frozenset({"trajectory"}))
            case Topic.GROUPS:
                return TopicSpec(topic, name, KeyedBy.TASK_ID, t, retention_ms=-1,
                                 event_types=frozenset({"group"}))
            case Topic.POLICY:
                # One record per weight push: small, kept as the history of which weights served when. The
                # proxy tier's heartbeats and update gates go here too (one partition: one order for the tier).
                return TopicSpec(topic, name, KeyedBy.SERVED_MODEL, 1, retention_ms=-1,
                                 event_types=frozenset({"policy.weights_updated", "policy.gate",
                                                        "policy.proxy_alive"}))
            case Topic.DEAD_LETTER:
                return TopicSpec(topic, name, KeyedBy.ORIGINAL_KEY, t, retention_ms=4 * _WEEK_MS,
                                 event_types=frozenset({"dead_letter"}))
        raise KeyError(topic)  # pragma: no cover - the match is exhaustive

    def name(self, topic: Topic) -> str:
        return self.prefix + topic.value

    def by_name(self, name: str) -> TopicSpec:
        """The spec for a full topic name; KeyError if it is not one of ours."""
        if not name.startswith(self.prefix):
            raise KeyError(f"{name!r} is not a rollwire topic under prefix {self.prefix!r}")
        return self.spec(Topic(name[len(self.prefix):]))
