"""The local Apache Kafka launcher: tool checks, broker configuration, lifecycle and topic set-up."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from typer.testing import CliRunner

from deploy.cli import app
from deploy.errors import MissingToolError
from deploy.kafka import KafkaBroker, KafkaConfig, broker_answers, ensure_topics, server_properties
from deploy.kafka_dist import resolve_kafka
from schemas.topics import MAX_MESSAGE_BYTES, Topic, TopicRegistry


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_missing_java_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingToolError, match="java not found.*openjdk-17"):
        KafkaBroker(KafkaConfig(cache_dir=tmp_path / "cache", home=tmp_path / "home"))._java_command(
            tmp_path, "kafka.Kafka")


def test_missing_maven_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = Path(os.popen("command -v java").read().strip())
    (bin_dir / "java").symlink_to(java)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(MissingToolError, match="mvn not found.*apt-get install maven"):
        resolve_kafka("4.3.1", tmp_path / "fresh-cache")


def test_broker_properties_admit_the_largest_event_and_transactions() -> None:
    config = KafkaConfig(home=Path("/srv/rw"), port=29092, controller_port=29093)
    properties = dict(line.split("=", 1) for line in server_properties(config).splitlines())
    assert int(properties["message.max.bytes"]) >= MAX_MESSAGE_BYTES
    assert int(properties["replica.fetch.max.bytes"]) >= int(properties["message.max.bytes"])
    assert properties["process.roles"] == "broker,controller"
    assert properties["transaction.state.log.replication.factor"] == "1"
    assert properties["transaction.state.log.min.isr"] == "1"
    assert properties["offsets.topic.replication.factor"] == "1"
    assert properties["auto.create.topics.enable"] == "false"
    assert properties["listeners"] == "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert properties["log.dirs"] == "/srv/rw/data"


def test_config_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLWIRE_KAFKA_PORT", "31000")
    config = KafkaConfig.from_env()
    assert config.home == tmp_path / "kafka"
    assert (config.port, config.controller_port, config.bootstrap) == (31000, 31001, "127.0.0.1:31000")


async def _topic_configs(bootstrap: str, name: str) -> dict[str, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
        [(_code, _msg, _type, _name, entries)] = response.resources
        return {entry[0]: entry[1] for entry in entries}
    finally:
        await admin.close()


@pytest.mark.kafka
async def test_broker_lifecycle_and_topics(tmp_path: Path) -> None:
    base = KafkaConfig.from_env()
    config = KafkaConfig(cache_dir=base.cache_dir, home=tmp_path / "kafka", port=_free_port(),
                         controller_port=_free_port())
    broker = KafkaBroker(config)
    assert not broker.is_running() and not broker_answers(config.bootstrap)
    broker.start(timeout_s=180)
    try:
        pid = broker.pid()
        assert pid is not None and broker_answers(config.bootstrap)
        broker.start()  # already running: a no-op
        assert broker.pid() == pid

        registry = TopicRegistry(prefix="lc.", session_partitions=3, task_partitions=2)
        created = await ensure_topics(config.bootstrap, registry)
        assert sorted(created) == sorted(spec.name for spec in registry.specs())
        assert await ensure_topics(config.bootstrap, registry) == []

        sessions = await _topic_configs(config.bootstrap, registry.name(Topic.SESSIONS))
        assert sessions["cleanup.policy"] == "compact"
        completions = await _topic_configs(config.bootstrap, registry.name(Topic.COMPLETIONS))
        assert completions["cleanup.policy"] == "delete"
        assert completions["max.message.bytes"] == str(MAX_MESSAGE_BYTES)
        assert completions["retention.ms"] == "-1"
        admin = AIOKafkaAdminClient(bootstrap_servers=config.bootstrap)
        await admin.start()
        try:
            described = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(
                [spec.name for spec in registry.specs()])}
        finally:
            await admin.close()
        assert described == {spec.name: spec.partitions for spec in registry.specs()}
    finally:
        broker.stop()
    assert not broker.is_running() and not broker_answers(config.bootstrap)
    broker.stop()  # stopping twice is fine


def test_status_reports_a_stopped_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLWIRE_KAFKA_PORT", str(_free_port()))
    monkeypatch.delenv("ROLLWIRE_KAFKA_BOOTSTRAP", raising=False)
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 3, result.output
    assert "kafka_running=False" in result.output and "kafka_answers=False" in result.output


def test_schemas_export_command_writes_every_schema(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["schemas", "export", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"completion.schema.json", "event.schema.json", "topics.json", "TaskRequest.schema.json"} <= written


def test_compose_file_runs_the_same_broker() -> None:
    """deploy/compose.yaml parses and matches the local launcher: version, limits, single-node settings."""
    import yaml

    from deploy.kafka import BATCH_OVERHEAD_BYTES, DEFAULT_VERSION

    compose = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "compose.yaml").read_text())
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{DEFAULT_VERSION}"
    env = kafka["environment"]
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) == MAX_MESSAGE_BYTES + BATCH_OVERHEAD_BYTES
    assert int(env["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= int(env["KAFKA_MESSAGE_MAX_BYTES"])
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    topics = compose["services"]["topics"]
    assert topics["environment"]["ROLLWIRE_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert "rollwire up" in " ".join(topics["command"])
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"


@pytest.mark.kafka
def test_up_against_an_existing_cluster_only_creates_topics(kafka_bootstrap: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With ROLLWIRE_KAFKA_BOOTSTRAP naming another broker (the compose case), `up` starts nothing."""
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLWIRE_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("ROLLWIRE_TOPIC_PREFIX", "upcmd.")
    monkeypatch.setenv("ROLLWIRE_KAFKA_PORT", str(_free_port()))
    first = CliRunner().invoke(app, ["up"])
    assert first.exit_code == 0, first.output
    assert "kafka_answers=True" in first.output and "kafka_managed=False" in first.output
    assert not (tmp_path / "kafka").exists()
    again = CliRunner().invoke(app, ["up"])
    assert "topics_created=0" in again.output


def test_up_fails_clearly_when_the_named_cluster_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_KAFKA_BOOTSTRAP", f"127.0.0.1:{_free_port()}")
    result = CliRunner().invoke(app, ["up"])
    assert result.exit_code == 1
    assert "no Kafka answers at ROLLWIRE_KAFKA_BOOTSTRAP" in result.output
