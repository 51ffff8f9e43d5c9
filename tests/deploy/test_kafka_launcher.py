"""The local Apache Kafka launcher (deploy/kafka.py): tool checks, broker settings, compose file, and a real
broker's lifecycle and size limits. One broker is started for the module (jars from the shared cache).
Topic administration (schemas/transport/admin.py) is tested in tests/transport/test_admin.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

import deploy.kafka
from deploy.errors import BrokerStartError, ConfigError, MissingToolError
from deploy.kafka import (
    BATCH_OVERHEAD_BYTES,
    DEFAULT_VERSION,
    KafkaBroker,
    KafkaConfig,
    server_properties,
)
from deploy.kafka_cluster import KafkaCluster, node_configs
from schemas.topics import MAX_MESSAGE_BYTES, Topic, TopicRegistry
from schemas.transport import KafkaSettings
from schemas.transport.admin import broker_answers, ensure_topics
from tests.servers import free_port

COMPOSE = Path(__file__).parents[2] / "deploy" / "compose.yaml"
DASHED_CLUSTER_ID = "-fLgT3PGSauCqcxwZXYsag"


def _properties(config: KafkaConfig) -> dict[str, str]:
    return dict(line.split("=", 1) for line in server_properties(config).splitlines())


def _bin_dir_with(tmp_path: Path, **scripts: str) -> Path:
    """A folder for PATH holding only the given executables (name -> shell script, or '' for the real one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in scripts.items():
        if body:
            (bin_dir / name).write_text("#!/bin/sh\n" + body)
            (bin_dir / name).chmod(stat.S_IRWXU)
        else:
            real = shutil.which(name)
            assert real, f"the test machine needs {name}"
            (bin_dir / name).symlink_to(real)
    return bin_dir


# --- tool checks: our own messages, with PATH pointing at what the test provides ---------------------------

def test_missing_java_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    broker = KafkaBroker(KafkaConfig(cache_dir=tmp_path / "cache", home=tmp_path / "home"))
    with pytest.raises(MissingToolError, match=r"Java 17\+ not found on PATH: install it, e\.g\. "
                                               r"`apt-get install openjdk-17-jre-headless`"):
        broker.ensure_distribution()


def test_java_older_than_17_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    old_java = 'echo \'openjdk version "11.0.20" 2023-07-18\' >&2\n'
    monkeypatch.setenv("PATH", str(_bin_dir_with(tmp_path, java=old_java)))
    broker = KafkaBroker(KafkaConfig(cache_dir=tmp_path / "cache", home=tmp_path / "home"))
    with pytest.raises(MissingToolError, match=r"Java 17\+ not found on PATH: .*java is Java 11"):
        broker.ensure_distribution()


def test_missing_maven_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(_bin_dir_with(tmp_path, java="")))
    broker = KafkaBroker(KafkaConfig(cache_dir=tmp_path / "fresh-cache", home=tmp_path / "home"))
    with pytest.raises(MissingToolError, match=r"mvn not found on PATH: install it, e\.g\. "
                                               r"`apt-get install maven`"):
        broker.ensure_distribution()


# --- configuration -------------------------------------------------------------------------------------------

def test_broker_properties_admit_the_largest_event_and_single_node_transactions() -> None:
    config = KafkaConfig(home=Path("/srv/rw/kafka"), port=29092, controller_port=29093)
    props = _properties(config)
    assert props["process.roles"] == "broker,controller" and props["node.id"] == "1"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:29093"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:29092"
    assert props["log.dirs"] == "/srv/rw/kafka/data"
    batch = MAX_MESSAGE_BYTES + BATCH_OVERHEAD_BYTES
    assert int(props["message.max.bytes"]) == batch
    assert int(props["replica.fetch.max.bytes"]) >= batch
    assert int(props["socket.request.max.bytes"]) >= 2 * batch
    for key in ("transaction.state.log.replication.factor", "transaction.state.log.min.isr",
                "offsets.topic.replication.factor", "share.coordinator.state.topic.replication.factor"):
        assert props[key] == "1", key
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["auto.create.topics.enable"] == "false"
    assert props["num.partitions"] == "1"
    assert props["default.replication.factor"] == "1" and props["min.insync.replicas"] == "1"
    assert props["unclean.leader.election.enable"] == "false"


def test_cluster_nodes_share_one_quorum_and_replicate_three_times(tmp_path: Path) -> None:
    """Three nodes laid out from the base port: ids 1..3, two ports each, one voter list and one cluster
    id, internal topics and topic defaults with 3 replicas and 2 in sync."""
    base = KafkaConfig(home=tmp_path / "kafka", port=29092)
    nodes = node_configs(base, 3)
    assert [(n.node_id, n.port, n.controller_port) for n in nodes] == [(1, 29092, 29093), (2, 29094, 29095),
                                                                      (3, 29096, 29097)]
    assert len({n.cluster_id for n in nodes}) == 1 and nodes[0].cluster_id
    assert [n.home for n in nodes] == [tmp_path / "kafka" / f"node-{i}" for i in (1, 2, 3)]
    for node in nodes:
        props = _properties(node)
        assert props["node.id"] == str(node.node_id)
        assert props["controller.quorum.voters"] == "1@127.0.0.1:29093,2@127.0.0.1:29095,3@127.0.0.1:29097"
        assert props["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{node.port}"
        assert props["log.dirs"] == str(node.home / "data")
        for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                    "share.coordinator.state.topic.replication.factor", "default.replication.factor"):
            assert props[key] == "3", key
        for key in ("transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr", "min.insync.replicas"):
            assert props[key] == "2", key
        assert props["unclean.leader.election.enable"] == "false"
    # Two nodes: both replicas, but one in sync suffices (else any death stops all writes).
    two = _properties(node_configs(base, 2)[0])
    assert two["default.replication.factor"] == "2" and two["min.insync.replicas"] == "1"


def test_cluster_settings_point_clients_at_every_node(tmp_path: Path) -> None:
    cluster = KafkaCluster(KafkaConfig(home=tmp_path), 3, [(41001, 41002), (41003, 41004), (41005, 41006)])
    settings = cluster.settings(KafkaSettings(topic_prefix="x."))
    assert settings.kafka_bootstrap == "127.0.0.1:41001,127.0.0.1:41003,127.0.0.1:41005"
    assert (settings.replication_factor, settings.min_insync_replicas) == (3, 2)
    explicit = cluster.settings(KafkaSettings(replication_factor=2, min_insync_replicas=1))
    assert (explicit.replication_factor, explicit.min_insync_replicas) == (2, 1)  # the environment wins
    assert KafkaCluster.load(KafkaConfig(home=tmp_path)) is None  # nothing laid out until a start


def test_a_laid_out_cluster_is_found_and_its_size_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy import stack
    from deploy.errors import DeployError

    for name in ("ROLLWIRE_KAFKA_BOOTSTRAP", "ROLLWIRE_REPLICATION_FACTOR", "ROLLWIRE_MIN_INSYNC_REPLICAS"):
        monkeypatch.delenv(name, raising=False)
    config = KafkaConfig(home=tmp_path)
    (tmp_path / "cluster.json").write_text(json.dumps({"cluster_id": "MkU3OEVBNTcwNTJENDM2Qk", "nodes": [
        {"node_id": i, "port": 42000 + 2 * i, "controller_port": 42001 + 2 * i} for i in (1, 2, 3)]}))
    found = stack.local_cluster(config)
    assert found is not None and [n.config.cluster_id for n in found.nodes] == ["MkU3OEVBNTcwNTJENDM2Qk"] * 3
    settings = stack.managed_settings(config)
    assert settings.kafka_bootstrap == "127.0.0.1:42002,127.0.0.1:42004,127.0.0.1:42006"
    assert settings.replication_factor == 3 and settings.min_insync_replicas == 2
    with pytest.raises(DeployError, match="holds a 3-broker cluster, not 5"):
        stack.local_cluster(config, 5)
    assert stack.local_cluster(KafkaConfig(home=tmp_path / "elsewhere"), 1) is None  # one node: no cluster
    (tmp_path / "cluster.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a cluster layout"):
        KafkaCluster.load(config)


@pytest.mark.parametrize("bad", [
    {"brokers": 0}, {"brokers": 2, "ports": [(1, 2)]}, {"brokers": 2, "ports": [(1, 2), (2, 3)]},
])
def test_bad_cluster_layouts_fail_in_the_constructor(bad: dict[str, object], tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        node_configs(KafkaConfig(home=tmp_path), **bad)  # type: ignore[arg-type]


def test_replication_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="ROLLWIRE_MIN_INSYNC_REPLICAS=3 exceeds ROLLWIRE_REPLICATION_FACTOR=2"):
        KafkaSettings(replication_factor=2, min_insync_replicas=3)


def test_larger_events_raise_the_broker_limits() -> None:
    props = _properties(KafkaConfig(max_message_bytes=32 * 1024 * 1024))
    assert int(props["message.max.bytes"]) == 32 * 1024 * 1024 + BATCH_OVERHEAD_BYTES
    assert int(props["socket.request.max.bytes"]) >= int(props["message.max.bytes"])


def test_config_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("ROLLWIRE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ROLLWIRE_KAFKA_PORT", "31000")
    config = KafkaConfig.from_env()
    assert config.home == tmp_path / "state" / "kafka"
    assert config.cache_dir == tmp_path / "cache"
    assert (config.port, config.controller_port, config.bootstrap) == (31000, 31001, "127.0.0.1:31000")
    assert config.version == DEFAULT_VERSION


@pytest.mark.parametrize("bad", [
    {"version": "3.9.0"}, {"version": "latest"}, {"port": 70000}, {"port": 19092, "controller_port": 19092},
    {"host": "0.0.0.0"}, {"heap": "768m"}, {"max_message_bytes": 0},
    {"node_id": 2, "quorum": ("1@127.0.0.1:19093",)},
])
def test_bad_settings_fail_in_the_constructor(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        KafkaConfig(**bad)  # type: ignore[arg-type]


def test_bad_port_variable_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_KAFKA_PORT", "nineteen")
    with pytest.raises(ConfigError, match="ROLLWIRE_KAFKA_PORT"):
        KafkaConfig.from_env()


def test_compose_runs_the_same_broker() -> None:
    """deploy/compose.yaml parses and runs apache/kafka at our version, KRaft, with the 8 MiB limits."""
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{DEFAULT_VERSION}"
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) == MAX_MESSAGE_BYTES + BATCH_OVERHEAD_BYTES
    assert int(env["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= int(env["KAFKA_MESSAGE_MAX_BYTES"])
    assert int(env["KAFKA_SOCKET_REQUEST_MAX_BYTES"]) >= int(env["KAFKA_MESSAGE_MAX_BYTES"])
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert len(env["CLUSTER_ID"]) == 22
    topics = compose["services"]["topics"]
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert topics["environment"]["ROLLWIRE_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert "rollwire up" in " ".join(topics["command"])


def test_compose_cluster_profile_runs_three_replicating_brokers() -> None:
    """The `cluster` profile: three nodes with one quorum and cluster id, replication 3 / min ISR 2, unclean
    election off, and a topics service that creates rollwire's topics with the same replication."""
    services = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    nodes = [services[f"kafka-{i}"] for i in (1, 2, 3)]
    envs = [node["environment"] for node in nodes]
    assert all(node["profiles"] == ["cluster"] and node["image"] == f"apache/kafka:{DEFAULT_VERSION}" for node in nodes)
    assert [env["KAFKA_NODE_ID"] for env in envs] == ["1", "2", "3"]
    assert len({env["CLUSTER_ID"] for env in envs}) == 1 and len(envs[0]["CLUSTER_ID"]) == 22
    assert {env["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in envs} == {"1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"}
    for i, (node, env) in enumerate(zip(nodes, envs, strict=True), start=1):
        assert env["KAFKA_ADVERTISED_LISTENERS"].startswith(f"INTERNAL://kafka-{i}:9092,")
        assert node["volumes"] == [f"kafka-{i}-data:/var/lib/kafka/data"]
        assert env["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3" and env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert env["KAFKA_UNCLEAN_LEADER_ELECTION_ENABLE"] == "false"
        assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
        assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) == MAX_MESSAGE_BYTES + BATCH_OVERHEAD_BYTES
    assert len({port for node in nodes for port in node["ports"]}) == 3
    topics = services["topics-cluster"]
    assert set(topics["depends_on"]) == {"kafka-1", "kafka-2", "kafka-3"}
    env = topics["environment"]
    assert env["ROLLWIRE_KAFKA_BOOTSTRAP"] == "kafka-1:9092,kafka-2:9092,kafka-3:9092"
    assert (env["ROLLWIRE_REPLICATION_FACTOR"], env["ROLLWIRE_MIN_INSYNC_REPLICAS"]) == ("3", "2")
    assert "kafka" in services and "profiles" not in services["kafka"]  # the single node stays the default


# --- a real broker -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A broker on free non-default ports in a fresh home; jars from the shared cache (ROLLWIRE_CACHE_DIR).

    Its cluster id starts with "-", as one random id in 64 does: the storage tool once read such an id as
    an option and refused to format.
    """
    config = KafkaConfig(cache_dir=KafkaConfig.from_env().cache_dir, home=tmp_path_factory.mktemp("home") / "kafka",
                         port=free_port(), controller_port=free_port())
    launched = KafkaBroker(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deploy.kafka, "new_cluster_id", lambda: DASHED_CLUSTER_ID)
        launched.start(timeout_s=240)
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def registry() -> TopicRegistry:
    return TopicRegistry(prefix="launcher.", session_partitions=3, task_partitions=2)


def _settings(broker: KafkaBroker, registry: TopicRegistry) -> KafkaSettings:
    return KafkaSettings(kafka_bootstrap=broker.config.bootstrap, topic_prefix=registry.prefix,
                         session_partitions=registry.session_partitions, task_partitions=registry.task_partitions)


@pytest.mark.kafka
def test_broker_runs_and_answers(broker: KafkaBroker) -> None:
    status = broker.status()
    assert status["running"] and status["pid"] == int(broker.pid_file.read_text())
    assert status["bootstrap"] == broker.config.bootstrap != "127.0.0.1:19092"
    assert status["version"] == DEFAULT_VERSION
    assert f"cluster.id={DASHED_CLUSTER_ID}" in Path(status["data_dir"], "meta.properties").read_text()
    assert broker_answers(broker.config.bootstrap, timeout_s=10)  # generous: CI machines can be loaded
    assert "Kafka Server started" in broker.log_file.read_text(encoding="utf-8")


@pytest.mark.kafka
def test_start_on_a_running_broker_is_a_no_op(broker: KafkaBroker) -> None:
    pid = broker.pid()
    started = time.monotonic()
    broker.start()
    assert broker.pid() == pid
    assert time.monotonic() - started < 5


@pytest.mark.kafka
def test_a_second_broker_on_a_taken_port_fails_before_launching(broker: KafkaBroker, tmp_path: Path) -> None:
    other = KafkaBroker(KafkaConfig(cache_dir=broker.config.cache_dir, home=tmp_path / "kafka",
                                    port=broker.config.port, controller_port=free_port()))
    with pytest.raises(BrokerStartError, match="another process uses it.*ROLLWIRE_KAFKA_PORT"):
        other.start(timeout_s=30)
    assert not other.pid_file.exists()


@pytest.mark.kafka
async def test_a_record_near_the_limit_is_accepted(broker: KafkaBroker, registry: TopicRegistry) -> None:
    """An event of almost 8 MiB is stored, on a registry topic (its max.message.bytes) and on a topic
    without overrides (the broker's message.max.bytes; Kafka's default of 1 MiB would refuse it)."""
    await ensure_topics(_settings(broker, registry))
    plain = "launcher.no-overrides"
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.config.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(plain, 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=broker.config.bootstrap, acks="all",
                                max_request_size=MAX_MESSAGE_BYTES + BATCH_OVERHEAD_BYTES)
    await producer.start()
    try:
        value = os.urandom(MAX_MESSAGE_BYTES - 4096)  # incompressible; leaves room for the batch header
        for topic in (registry.name(Topic.COMPLETIONS), plain):
            sent = await producer.send_and_wait(topic, value, key=b"session-1")
            assert sent.topic == topic and sent.offset >= 0
    finally:
        await producer.stop()


@pytest.mark.kafka
async def test_transactions_work_on_one_node(broker: KafkaBroker, registry: TopicRegistry) -> None:
    """transaction.state.log.* = 1 on one node; with Kafka's defaults (3) a transactional producer hangs."""
    await ensure_topics(_settings(broker, registry))
    producer = AIOKafkaProducer(bootstrap_servers=broker.config.bootstrap, transactional_id="launcher-test",
                                enable_idempotence=True)
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(registry.name(Topic.SESSION_EVENTS), b"{}", key=b"session-1")
    finally:
        await producer.stop()


@pytest.mark.kafka
def test_a_broker_that_dies_while_starting_reports_its_log(tmp_path: Path, broker: KafkaBroker) -> None:
    config = KafkaConfig(cache_dir=broker.config.cache_dir, home=tmp_path / "kafka", port=free_port(),
                         controller_port=free_port())
    (config.home / "data").mkdir(parents=True)  # storage "formatted" by another node: Kafka refuses it
    (config.home / "data" / "meta.properties").write_text("version=1\nnode.id=7\ncluster.id=AAAAAAAAAAAAAAAAAAAAAA\n")
    dying = KafkaBroker(config)
    with pytest.raises(BrokerStartError, match=r"(?s)exited with code 1 while starting.*Stored node id 7"):
        dying.start(timeout_s=60)
    assert not dying.is_running() and not dying.pid_file.exists()


@pytest.mark.kafka
def test_stop_stops_the_broker_and_can_be_repeated(broker: KafkaBroker) -> None:
    """Last in the module: it stops the shared broker."""
    pid = broker.pid()
    assert pid is not None
    broker.stop()
    assert not broker.is_running() and not broker.pid_file.exists()
    assert not broker_answers(broker.config.bootstrap)
    assert not Path(f"/proc/{pid}").exists() or b"kafka.Kafka" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    broker.stop()
