"""Topic administration: the one place that creates, checks, describes and deletes rollwire's topics.

Every service and the deploy tooling go through here, never through their own admin client:

- :func:`ensure_topics` creates the registry's topics (schemas/topics.py) and a caller's extra topics
  (:class:`ExtraTopic`: the trajectory worker's control topic, the groups worker's by-task topic, a
  rebuild's output topic), all with the size limits derived from ``FRAMING_BYTES`` and the settings'
  replication (``replication_factor`` replicas, ``min.insync.replicas``, no unclean leader election); an
  existing registry
  topic must have the registry's partition count (co-partitioning depends on it); a topic that someone
  else creates meanwhile counts as existing; it returns once every partition has a leader.
- :func:`delete_topics` deletes a prefix's topics (tests and benchmarks clean up their throwaway ones).
- :func:`cluster_id` and :class:`KafkaAdmin` describe the cluster (its id, partition counts, the members of
  a consumer group).
- :func:`broker_answers` tells, synchronously, whether a broker answers at all.

aiokafka's errors are translated into :class:`~schemas.transport.errors.TopicSetupError` (topic set-up) or
:class:`~schemas.transport.errors.TransportError` (describing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    GroupCoordinatorNotAvailableError,
    GroupLoadInProgressError,
    InvalidReplicationFactorError,
    KafkaError,
    NotCoordinatorForGroupError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    for_code,
)

from schemas.topics import FRAMING_BYTES, MAX_MESSAGE_BYTES, TopicSpec
from schemas.transport.errors import TopicSetupError, TransportError
from schemas.transport.settings import KafkaSettings

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ExtraTopic:
    """A topic a worker needs besides the registry's, created with the deployment's size limits."""

    name: str
    partitions: int
    retention_ms: int = -1
    compacted: bool = False
    compression: str = "producer"

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ValueError(f"topic {self.name!r} needs at least one partition, not {self.partitions}")

    @classmethod
    def like(cls, spec: TopicSpec, name: str | None = None) -> ExtraTopic:
        """A registry topic's partitions, retention, clean-up policy and compression, under ``name``
        (default: its own)."""
        return cls(name or spec.name, spec.partitions, spec.retention_ms, spec.compacted, spec.compression)

    def configs(self, max_message_bytes: int = MAX_MESSAGE_BYTES, min_insync_replicas: int = 1) -> dict[str, str]:
        """Topic-level broker configs, the same keys as :meth:`schemas.topics.TopicSpec.configs`, and the
        replication guarantees."""
        return {
            # A topic's limit applies to whole batches: room for their framing (schemas/topics.py).
            "max.message.bytes": str(max_message_bytes + FRAMING_BYTES),
            "cleanup.policy": "compact" if self.compacted else "delete",
            "retention.ms": str(self.retention_ms),
            "compression.type": self.compression,
            # With acks=all, an acknowledged write is on this many replicas; fewer in sync refuse writes.
            "min.insync.replicas": str(min_insync_replicas),
            # Kafka's default, stated: a replica that missed acknowledged writes never becomes leader.
            "unclean.leader.election.enable": "false",
        }


@dataclass(frozen=True, slots=True)
class PartitionState:
    """Where one partition lives: its leader's node id (-1: none), its replicas and those in sync."""

    partition: int
    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


class KafkaAdmin:
    """One admin connection to a cluster: ``async with KafkaAdmin(bootstrap) as admin``.

    Kept open by callers that ask repeatedly (the gateway's group members); the module's functions open
    one per call.
    """

    def __init__(self, bootstrap: str, *, client_id: str = "rollwire-admin",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.bootstrap = bootstrap
        self.timeout_s = timeout_s
        self._admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id=client_id,
                                          request_timeout_ms=int(timeout_s * 1000))
        self._started = False

    async def start(self) -> None:
        if self._started:
            return
        try:
            await self._admin.start()
        except KafkaError as exc:
            await self._admin.close()
            raise TransportError(f"cannot reach Kafka at {self.bootstrap}: {exc!r}") from exc
        self._started = True

    async def stop(self) -> None:
        """Close the connection; safe to call twice."""
        if self._started:
            self._started = False
            await self._admin.close()

    async def __aenter__(self) -> KafkaAdmin:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def topic_names(self) -> set[str]:
        """Every topic on the cluster."""
        try:
            return set(await self._admin.list_topics())
        except KafkaError as exc:
            raise TopicSetupError(f"Kafka at {self.bootstrap} did not list its topics: {exc!r}") from exc

    async def partition_counts(self, names: Iterable[str]) -> dict[str, int]:
        """The partition count of each named topic that exists (and answers); others are absent."""
        try:
            described = await self._admin.describe_topics(list(names))
        except KafkaError as exc:
            raise TopicSetupError(f"Kafka at {self.bootstrap} did not describe its topics: {exc!r}") from exc
        return {topic["topic"]: len(topic["partitions"]) for topic in described if topic["error_code"] == 0}

    async def partitions(self, name: str, *, unknown_wait_s: float = 10.0) -> list[PartitionState]:
        """Each partition of topic ``name`` with its leader and replicas, by partition number.

        In a cluster, the node asked may not have heard yet of a topic created a moment ago (the
        controller's metadata reaches each broker on its own time): an unknown topic is asked about again
        for up to ``unknown_wait_s`` before it is an error (seen in CI on a fresh three-node cluster)."""
        deadline = time.monotonic() + unknown_wait_s
        while True:
            try:
                (described,) = await self._admin.describe_topics([name])
            except KafkaError as exc:
                raise TransportError(f"Kafka at {self.bootstrap} did not describe {name}: {exc!r}") from exc
            code = described["error_code"]
            if code == UnknownTopicOrPartitionError.errno and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                continue
            break
        if code != 0:
            raise TransportError(f"Kafka at {self.bootstrap} cannot describe {name}: {for_code(code).__name__}")
        return sorted((PartitionState(p["partition"], p["leader"], tuple(p["replicas"]), tuple(p["isr"]))
                       for p in described["partitions"]), key=lambda state: state.partition)

    async def topic_config(self, name: str, key: str) -> str | None:
        """The value of topic config ``key`` of topic ``name`` as the broker applies it (set on the topic,
        or the broker's default); None when the broker does not report it."""
        try:
            (response,) = await self._admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name, {key: None})])
        except KafkaError as exc:
            raise TransportError(f"Kafka at {self.bootstrap} did not describe {name}'s configs: {exc!r}") from exc
        for error_code, error_message, _type, resource, entries in response.resources:
            if resource != name:
                continue
            if error_code:
                raise TransportError(f"Kafka at {self.bootstrap} cannot describe {name}'s configs: "
                                     f"{for_code(error_code).__name__} {error_message or ''}".rstrip())
            for entry in entries:
                if entry[0] == key:
                    return entry[1]
        return None

    async def broker_ids(self) -> list[int]:
        """The node ids of the brokers the cluster reports as alive (registered and not fenced)."""
        try:
            brokers = (await self._admin.describe_cluster())["brokers"]
        except KafkaError as exc:
            raise TransportError(f"Kafka at {self.bootstrap} did not describe its brokers: {exc!r}") from exc
        return sorted(int(broker["node_id"]) for broker in brokers)

    async def create(self, topics: Sequence[ExtraTopic], max_message_bytes: int = MAX_MESSAGE_BYTES, *,
                     replication_factor: int = 1, min_insync_replicas: int = 1,
                     settle_s: float = 15.0) -> list[str]:
        """Create ``topics`` with ``replication_factor`` replicas each; return those this call created. A
        topic that exists already, or that another client creates at the same moment, is not an error.

        A cluster that has just started may list enough live brokers while its controller does not count
        them all yet, and refuses the replication factor: while the brokers listed are enough, the topics
        refused for that reason are asked for again, for up to ``settle_s`` (fewer brokers than replicas is
        an error at once)."""
        deadline = time.monotonic() + settle_s
        created: list[str] = []
        while True:
            done, short, failures = await self._create_once(topics, max_message_bytes, replication_factor,
                                                            min_insync_replicas)
            created += done
            if short and not failures and time.monotonic() < deadline \
                    and len(await self.broker_ids()) >= replication_factor:
                topics = [t for t in topics if t.name in short]
                await asyncio.sleep(0.5)
                continue
            failures += [f"{name}: the cluster has fewer live brokers than {replication_factor} replicas "
                         "(ROLLWIRE_REPLICATION_FACTOR)" for name in short]
            if failures:
                raise TopicSetupError("creating topics failed: " + "; ".join(failures))
            return created

    async def _create_once(self, topics: Sequence[ExtraTopic], max_message_bytes: int, replication_factor: int,
                           min_insync_replicas: int) -> tuple[list[str], set[str], list[str]]:
        """One CreateTopics request: (created, refused for too few live brokers, other failures)."""
        if not topics:
            return [], set(), []
        new = [NewTopic(t.name, t.partitions, replication_factor,
                        topic_configs=t.configs(max_message_bytes, min_insync_replicas)) for t in topics]
        try:
            response = await self._admin.create_topics(new, timeout_ms=int(self.timeout_s * 1000))
        except KafkaError as exc:
            raise TopicSetupError(f"Kafka at {self.bootstrap} refused topic set-up: {exc!r}") from exc
        created, short, failures = [], set(), []
        for entry in response.topic_errors:
            name, code, message = entry[0], entry[1], (entry[2] if len(entry) > 2 else None)
            if code == 0:
                created.append(name)
            elif code == InvalidReplicationFactorError.errno:
                short.add(name)
            elif code != TopicAlreadyExistsError.errno:
                failures.append(f"{name}: {for_code(code).__name__} {message or ''}".strip())
        return created, short, failures

    async def wait_for_leaders(self, names: Sequence[str], deadline: float) -> None:
        """Return once every partition of every named topic has a leader (``deadline``: time.monotonic())."""
        while True:
            try:
                described = await self._admin.describe_topics(list(names))
            except KafkaError as exc:
                raise TopicSetupError(f"Kafka at {self.bootstrap} did not describe {names}: {exc!r}") from exc
            if len(described) == len(names) and all(_has_leaders(topic) for topic in described):
                return
            if time.monotonic() > deadline:
                raise TopicSetupError(f"topics {list(names)} still have partitions without a leader; is the "
                                      "broker healthy?")
            await asyncio.sleep(0.1)

    async def delete(self, names: Sequence[str]) -> None:
        """Delete the named topics (their data is gone)."""
        try:
            await self._admin.delete_topics(list(names), timeout_ms=int(self.timeout_s * 1000))
        except KafkaError as exc:
            raise TopicSetupError(f"Kafka at {self.bootstrap} refused to delete {names}: {exc!r}") from exc

    async def cluster_id(self) -> str:
        """The id the cluster reports (a new one for every freshly formatted broker)."""
        try:
            found = (await self._admin.describe_cluster()).get("cluster_id")
        except KafkaError as exc:
            raise TransportError(f"Kafka at {self.bootstrap} did not say its cluster id: {exc!r}") from exc
        if not found:
            raise TransportError(f"Kafka at {self.bootstrap} reports no cluster id")
        return str(found)

    async def group_client_ids(self, group: str) -> list[str]:
        """The client ids of a consumer group's current members (empty when the group has none)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                responses = await self._admin.describe_consumer_groups([group])
                break
            except _COORDINATOR_MOVING as exc:
                # A fresh cluster creates its offsets topic on the first lookup; a failover moves the
                # coordinator: both answer "not available" for a moment.
                if time.monotonic() > deadline:
                    raise TransportError(f"describing consumer group {group}: {exc!r}") from exc
                await asyncio.sleep(0.2)
            except KafkaError as exc:
                raise TransportError(f"describing consumer group {group}: {exc!r}") from exc
        # Each group: (error_code, group_id, state, protocol_type, protocol, members[, authorized_operations]);
        # each member: (member_id, client_id, client_host, metadata, assignment).
        return [member[1] for response in responses for described in response.groups for member in described[5]]


_COORDINATOR_MOVING = (GroupCoordinatorNotAvailableError, GroupLoadInProgressError, NotCoordinatorForGroupError)


def _has_leaders(topic: dict[str, Any]) -> bool:
    return bool(topic["error_code"] == 0 and topic["partitions"]
                and all(partition["leader"] >= 0 for partition in topic["partitions"]))


def _check_partitions(have: dict[str, int], specs: Sequence[TopicSpec]) -> None:
    for spec in specs:
        if spec.name in have and have[spec.name] != spec.partitions:
            raise TopicSetupError(
                f"topic {spec.name} has {have[spec.name]} partitions but the registry wants {spec.partitions} "
                "(co-partitioned topics must agree): set ROLLWIRE_SESSION_PARTITIONS / ROLLWIRE_TASK_PARTITIONS "
                "to match the cluster, or use another ROLLWIRE_TOPIC_PREFIX")


def _wanted(specs: Sequence[TopicSpec], extra: Sequence[ExtraTopic]) -> list[ExtraTopic]:
    """The registry's topics, then the extra ones; an extra topic named like a registry topic is dropped."""
    wanted = {spec.name: ExtraTopic.like(spec) for spec in specs}
    for topic in extra:
        wanted.setdefault(topic.name, topic)
    return list(wanted.values())


async def ensure_topics(settings: KafkaSettings, extra: Sequence[ExtraTopic] = (), *,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Create the registry's missing topics and the missing ``extra`` topics; return the names created.

    Returns once every one of them has a leader on each partition. A registry topic that exists already is
    kept, but must have the registry's partition count (raises TopicSetupError otherwise); an existing
    extra topic is kept as it is.
    """
    deadline = time.monotonic() + timeout_s
    specs = settings.registry().specs()
    wanted = _wanted(specs, extra)
    try:
        async with KafkaAdmin(settings.kafka_bootstrap, client_id=f"{settings.kafka_client_id}-admin",
                              timeout_s=timeout_s) as admin:
            existing = await admin.topic_names()
            present = [spec.name for spec in specs if spec.name in existing]
            if present:
                _check_partitions(await admin.partition_counts(present), specs)
            created = await admin.create([t for t in wanted if t.name not in existing], settings.max_message_bytes,
                                         replication_factor=settings.replication_factor,
                                         min_insync_replicas=settings.min_insync_replicas)
            await admin.wait_for_leaders([t.name for t in wanted], deadline)
            return created
    except TopicSetupError:
        raise
    except TransportError as exc:
        raise TopicSetupError(f"Kafka at {settings.kafka_bootstrap} refused topic set-up: {exc}") from exc


async def delete_topics(bootstrap: str, prefix: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Delete every topic whose name starts with ``prefix`` (a deployment's topics and its workers'
    changelogs); return their names. Tests and benchmarks call it for their throwaway prefixes: a broker
    that keeps every one of them runs out of file descriptors (three per partition segment)."""
    if not prefix:
        raise ValueError("refusing to delete topics without a prefix")
    try:
        async with KafkaAdmin(bootstrap, timeout_s=timeout_s) as admin:
            doomed = sorted(name for name in await admin.topic_names() if name.startswith(prefix))
            if doomed:
                await admin.delete(doomed)
            return doomed
    except TopicSetupError:
        raise
    except TransportError as exc:
        raise TopicSetupError(f"Kafka at {bootstrap} refused to delete topics under {prefix!r}: {exc}") from exc


async def cluster_id(bootstrap: str) -> str:
    """The cluster id the brokers at ``bootstrap`` report; TransportError if they do not."""
    async with KafkaAdmin(bootstrap) as admin:
        return await admin.cluster_id()


def _accepts_tcp(bootstrap: str, timeout_s: float) -> bool:
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bootstrap entry {server!r} must be host:port")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


async def _answers(bootstrap: str, timeout_s: float) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            cluster = await admin.describe_cluster()
        return bool(cluster.get("brokers"))
    except (KafkaError, OSError, TimeoutError):
        return False
    finally:
        await admin.close()


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def broker_answers(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """Whether a Kafka cluster at ``bootstrap`` answers a metadata request naming at least one broker.

    A TCP connect is tried first, so that a closed port costs no Kafka client (and logs nothing).
    Blocking: from async code call it in a thread. ValueError for an entry that is not ``host:port``.
    """
    if not _accepts_tcp(bootstrap, timeout_s):
        return False
    return _run_sync(_answers(bootstrap, timeout_s))
