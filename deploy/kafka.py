"""The project's own Apache Kafka: one KRaft node (broker + controller) run from Maven-resolved jars.

``KafkaBroker`` writes the broker's configuration into its home, formats the storage on first start,
runs ``java kafka.Kafka`` detached (so it outlives the command that started it), waits until it answers a
real Kafka request, and stops it. ``ensure_topics`` creates the registry's topics. Used by
``rollwire up/down/status`` and by the test fixture.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from deploy.errors import BrokerStartError, DeployError
from deploy.kafka_dist import require_java, resolve_kafka, template
from schemas.topics import MAX_MESSAGE_BYTES, TopicRegistry

DEFAULT_VERSION = "4.3.1"
# A record batch adds headers around the largest record, and the broker's limit applies to the batch.
BATCH_OVERHEAD_BYTES = 64 * 1024
_TOPIC_ALREADY_EXISTS = 36


def _env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else default


@dataclass(frozen=True)
class KafkaConfig:
    """Where the local broker keeps its jars and data, and where it listens."""

    version: str = DEFAULT_VERSION
    cache_dir: Path = field(default_factory=lambda: Path("~/.cache/rollwire").expanduser())
    home: Path = field(default_factory=lambda: Path("~/.rollwire/kafka").expanduser())
    host: str = "127.0.0.1"
    port: int = 19092
    controller_port: int = 19093
    heap: str = "-Xms256m -Xmx768m"
    max_message_bytes: int = MAX_MESSAGE_BYTES

    @classmethod
    def from_env(cls) -> KafkaConfig:
        """``ROLLWIRE_CACHE_DIR``, ``ROLLWIRE_HOME`` (broker state in its ``kafka/``),
        ``ROLLWIRE_KAFKA_PORT`` (controller on the next port), ``ROLLWIRE_KAFKA_VERSION``,
        ``ROLLWIRE_KAFKA_HEAP``, ``ROLLWIRE_MAX_MESSAGE_BYTES``."""
        port = int(os.environ.get("ROLLWIRE_KAFKA_PORT", "19092"))
        return cls(
            version=os.environ.get("ROLLWIRE_KAFKA_VERSION", DEFAULT_VERSION),
            cache_dir=_env_path("ROLLWIRE_CACHE_DIR", Path("~/.cache/rollwire").expanduser()),
            home=_env_path("ROLLWIRE_HOME", Path("~/.rollwire").expanduser()) / "kafka",
            port=port,
            controller_port=port + 1,
            heap=os.environ.get("ROLLWIRE_KAFKA_HEAP", "-Xms256m -Xmx768m"),
            max_message_bytes=int(os.environ.get("ROLLWIRE_MAX_MESSAGE_BYTES", str(MAX_MESSAGE_BYTES))),
        )

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


def server_properties(config: KafkaConfig) -> str:
    """The broker's server.properties for a single combined KRaft node."""
    batch_limit = config.max_message_bytes + BATCH_OVERHEAD_BYTES
    settings: dict[str, Any] = {
        "process.roles": "broker,controller",
        "node.id": 1,
        "controller.quorum.voters": f"1@{config.host}:{config.controller_port}",
        "listeners": f"PLAINTEXT://{config.host}:{config.port},CONTROLLER://{config.host}:{config.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{config.host}:{config.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(config.home / "data"),
        "num.partitions": 1,
        "auto.create.topics.enable": "false",
        # Large records: every limit on the path of one record batch admits the largest event.
        "message.max.bytes": batch_limit,
        "replica.fetch.max.bytes": batch_limit,
        "socket.request.max.bytes": max(104857600, 4 * batch_limit),
        # One node: internal topics (offsets, transactions, share groups) with replication 1, so that
        # consumer groups and transactional producers work.
        "offsets.topic.replication.factor": 1,
        "offsets.topic.num.partitions": 8,
        "transaction.state.log.replication.factor": 1,
        "transaction.state.log.min.isr": 1,
        "transaction.state.log.num.partitions": 8,
        "share.coordinator.state.topic.replication.factor": 1,
        "share.coordinator.state.topic.min.isr": 1,
        # Tests and the CLI create groups often; do not hold the first rebalance back.
        "group.initial.rebalance.delay.ms": 0,
        "log.retention.check.interval.ms": 300000,
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def _run_async(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, even when an event loop is running here."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _answers(bootstrap: str, timeout_s: float) -> bool:
    # A refused connection is the expected answer while a broker starts: keep aiokafka from logging it.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        await asyncio.wait_for(admin.describe_cluster(), timeout_s)
        return True
    except (KafkaError, OSError, asyncio.TimeoutError):
        return False
    finally:
        await admin.close()


def broker_answers(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """Whether a Kafka broker at ``bootstrap`` answers a metadata request (not just a TCP connect)."""
    return bool(_run_async(_answers(bootstrap, timeout_s)))


class KafkaBroker:
    """Start, stop and inspect the local broker described by a :class:`KafkaConfig`."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        self.pid_file = config.home / "broker.pid"
        self.log_file = config.home / "logs" / "broker.log"

    def ensure_distribution(self) -> Path:
        return resolve_kafka(self.config.version, self.config.cache_dir)

    def _java_command(self, libs: Path, main_class: str, *args: str) -> list[str]:
        log4j = self.config.home / "log4j2.xml"
        return [require_java(), *self.config.heap.split(), "-XX:+UseG1GC", "-XX:+ExitOnOutOfMemoryError",
                "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={log4j}",
                f"-Drollwire.log.file={self.log_file}", "-cp", f"{libs}/*", main_class, *args]

    def _prepare(self, libs: Path) -> Path:
        home = self.config.home
        (home / "logs").mkdir(parents=True, exist_ok=True)
        properties = home / "server.properties"
        properties.write_text(server_properties(self.config), encoding="utf-8")
        (home / "log4j2.xml").write_text(template("log4j2.xml"), encoding="utf-8")
        if not (home / "data" / "meta.properties").exists():
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            result = subprocess.run(
                self._java_command(libs, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c",
                                   str(properties)),
                capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise BrokerStartError(f"formatting Kafka storage in {home / 'data'} failed:\n"
                                       f"{(result.stdout + result.stderr).strip()[-3000:]}")
        return properties

    def pid(self) -> int | None:
        """The broker's pid if its process is alive."""
        try:
            pid = int(self.pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if b"kafka.Kafka" in cmdline else None

    def is_running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout_s: float = 120) -> None:
        """Start the broker unless it runs already; return once it answers Kafka requests."""
        if self.is_running() and broker_answers(self.config.bootstrap):
            return
        libs = self.ensure_distribution()
        properties = self._prepare(libs)
        stdout = open(self.config.home / "logs" / "stdout.log", "ab")  # noqa: SIM115 - owned by the child
        process = subprocess.Popen(self._java_command(libs, "kafka.Kafka", str(properties)),
                                   stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=self.config.home, start_new_session=True)
        stdout.close()
        self.pid_file.write_text(str(process.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BrokerStartError(f"Kafka exited with code {process.returncode} while starting:\n"
                                       + self._log_tail())
            if broker_answers(self.config.bootstrap, timeout_s=2.0):
                return
            time.sleep(0.5)
        self.stop()
        raise BrokerStartError(f"Kafka did not answer at {self.config.bootstrap} within {timeout_s:.0f} s:\n"
                               + self._log_tail())

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout_s``); does nothing if it is not running."""
        pid = self.pid()
        if pid is not None:
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.pid() is not None:
                os.killpg(pid, signal.SIGKILL)
                time.sleep(0.5)
        self.pid_file.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        return {"running": self.is_running(), "pid": self.pid(), "bootstrap": self.config.bootstrap,
                "version": self.config.version, "data_dir": str(self.config.home / "data"),
                "log": str(self.log_file)}

    def _log_tail(self, lines: int = 40) -> str:
        chunks = []
        for path in (self.config.home / "logs" / "stdout.log", self.log_file):
            if path.exists():
                chunks.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(chunks[-lines:]) or "(no log output)"


async def ensure_topics(bootstrap: str, registry: TopicRegistry, max_message_bytes: int = MAX_MESSAGE_BYTES,
                        timeout_s: float = 60) -> list[str]:
    """Create the registry's missing topics; return the names created once every partition has a leader."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        missing = [spec for spec in registry.specs() if spec.name not in existing]
        if missing:
            response = await admin.create_topics([
                NewTopic(spec.name, spec.partitions, 1, topic_configs=spec.configs(max_message_bytes))
                for spec in missing
            ])
            for name, code, *message in response.topic_errors:
                if code not in (0, _TOPIC_ALREADY_EXISTS):
                    raise DeployError(f"creating topic {name} failed (error {code}): {message}")
        await _wait_for_leaders(admin, [spec.name for spec in registry.specs()], timeout_s)
        return [spec.name for spec in missing]
    except KafkaError as exc:
        raise DeployError(f"Kafka at {bootstrap} refused topic set-up: {exc!r}") from exc
    finally:
        await admin.close()


async def _wait_for_leaders(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        described = await admin.describe_topics(names)
        ready = all(t["error_code"] == 0 and t["partitions"]
                    and all(p["leader"] >= 0 for p in t["partitions"]) for t in described)
        if ready:
            return
        if time.monotonic() > deadline:
            raise DeployError(f"topics {names} have no leaders after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)
