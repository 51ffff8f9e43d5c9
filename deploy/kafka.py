"""The project's own Apache Kafka: one KRaft node (broker and controller in one JVM) run from Maven jars.

A node is alone (the development broker) or one voter of a cluster (``KafkaConfig.quorum``: every
voter's ``id@host:controller_port``, and the ``cluster_id`` they all format with); deploy/kafka_cluster.py
runs such clusters. A node of a cluster of three or more replicates Kafka's internal topics three times
with two in sync, and sets the same defaults for topics created without them.

``KafkaBroker`` resolves the jars (``deploy.kafka_dist``), writes ``server.properties`` and ``log4j2.xml``
into its home, formats the storage on first start, runs ``java kafka.Kafka`` detached (it outlives the
command that started it; stdout and stderr go to ``<home>/logs/broker.log``), waits until the broker answers
a real Kafka request (``schemas.transport.admin.broker_answers``), and stops it. Topics are not its
business: ``schemas.transport.admin.ensure_topics`` creates them on any cluster. Used by ``rollwire
up/down/status``, the test fixtures and the benchmarks. Linux and macOS (POSIX signals).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.errors import BrokerStartError, BrokerStopError, ConfigError
from deploy.kafka_dist import file_lock, require_java, resolve_kafka, template
from deploy.settings import DEFAULT_KAFKA_HEAP, DEFAULT_KAFKA_PORT, DEFAULT_KAFKA_VERSION, KafkaLauncherSettings, load
from schemas import paths
from schemas.topics import FRAMING_BYTES, MAX_MESSAGE_BYTES
from schemas.transport.admin import broker_answers
from schemas.transport.settings import KafkaSettings

# 4.3.1 rather than the newest minor (4.4.0, which also runs with aiokafka 0.14): a bug-fix release of a
# settled line rather than an x.y.0. Keep equal to the image tag in deploy/compose.yaml.
DEFAULT_VERSION = DEFAULT_KAFKA_VERSION
DEFAULT_PORT = DEFAULT_KAFKA_PORT
DEFAULT_HEAP = DEFAULT_KAFKA_HEAP
# message.max.bytes limits a record *batch* as the broker stores it: the largest record plus the batch header
# (61 bytes), per-record varint framing, key and headers. With the limit at exactly max_message_bytes, a
# record of that size would be refused, so the broker-wide limits leave the same room as the clients'
# (schemas.topics.FRAMING_BYTES, 64 KiB).
BATCH_OVERHEAD_BYTES = FRAMING_BYTES
# Kafka's own kafka-run-class.sh flags (G1 tuned for throughput, not start-up time), plus: die on OOM
# instead of limping, and no AWT.
_JVM_FLAGS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
              "-XX:+ExplicitGCInvokesConcurrent", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
_ROTATE_LOG_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class KafkaConfig:
    """Which Kafka to run, where its jars and state live, where it listens, and its size limits."""

    version: str = DEFAULT_VERSION
    cache_dir: Path = field(default_factory=paths.cache_dir)
    home: Path = field(default_factory=lambda: paths.home() / "kafka")
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    controller_port: int = DEFAULT_PORT + 1
    heap: str = DEFAULT_HEAP
    max_message_bytes: int = MAX_MESSAGE_BYTES
    node_id: int = 1
    quorum: tuple[str, ...] = ()
    """The controller quorum of a cluster, ``id@host:port`` per voter (this node's included); empty: alone."""
    cluster_id: str | None = None
    """The id to format the storage with (a cluster's nodes must share it); None: a new random one."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        object.__setattr__(self, "home", Path(self.home).expanduser())
        major = re.match(r"(\d+)\.\d+\.\d+\S*$", self.version)
        if major is None or int(major.group(1)) < 4:
            raise ConfigError(f"Kafka version {self.version!r} is not a 4.x release; set ROLLWIRE_KAFKA_VERSION "
                              f"to one such as {DEFAULT_VERSION}")
        for name, port in (("port", self.port), ("controller_port", self.controller_port)):
            if not 0 < port < 65536:
                raise ConfigError(f"Kafka {name} {port} is out of range; set ROLLWIRE_KAFKA_PORT to 1-65534 "
                                  "(the controller listens on the next port)")
        if self.port == self.controller_port:
            raise ConfigError(f"the broker and the controller cannot share port {self.port}; give them two")
        if self.host in ("", "0.0.0.0", "::"):
            raise ConfigError(f"host {self.host!r} cannot be advertised to clients; use the address they "
                              "connect to (127.0.0.1 by default)")
        if not 1024 <= self.max_message_bytes <= 512 * 1024 * 1024:
            raise ConfigError(f"max_message_bytes {self.max_message_bytes} must be between 1 KiB and 512 MiB; "
                              "set ROLLWIRE_MAX_MESSAGE_BYTES")
        if not self.heap.split() or any(not opt.startswith("-") for opt in self.heap.split()):
            raise ConfigError(f"heap {self.heap!r} must be JVM options such as {DEFAULT_HEAP!r}; "
                              "set ROLLWIRE_KAFKA_HEAP")
        object.__setattr__(self, "quorum", tuple(self.quorum))
        if self.node_id < 0:
            raise ConfigError(f"node id {self.node_id} must be 0 or more")
        if self.quorum and self.voter not in self.quorum:
            raise ConfigError(f"node {self.voter} is not among the quorum's voters {','.join(self.quorum)}")

    @classmethod
    def from_env(cls) -> KafkaConfig:
        """The configuration from the environment (``deploy.settings.KafkaLauncherSettings``, the home and
        cache folders, ``ROLLWIRE_MAX_MESSAGE_BYTES``); every variable is optional."""
        launcher = load(KafkaLauncherSettings)
        return cls(
            version=launcher.version.strip(),
            cache_dir=paths.cache_dir(),
            home=paths.home() / "kafka",
            port=launcher.port,
            controller_port=launcher.port + 1,
            heap=launcher.heap.strip(),
            max_message_bytes=load(KafkaSettings).max_message_bytes,
        )

    @property
    def bootstrap(self) -> str:
        """The address clients connect to, ``host:port``."""
        return f"{self.host}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def voter(self) -> str:
        """This node as a controller quorum voter, ``id@host:controller_port``."""
        return f"{self.node_id}@{self.host}:{self.controller_port}"

    @property
    def replicas(self) -> int:
        """Replicas of internal topics and the default for new topics: three where the cluster has them."""
        return min(3, max(1, len(self.quorum)))

    @property
    def min_insync_replicas(self) -> int:
        """Two of three in sync (one broker may die without losing an acknowledged write); else one."""
        return 2 if self.replicas >= 3 else 1


def server_properties(config: KafkaConfig) -> str:
    """The broker's ``server.properties``: one combined KRaft node (no comments, one ``key=value`` a line)."""
    batch_limit = config.max_message_bytes + BATCH_OVERHEAD_BYTES
    settings: dict[str, object] = {
        "process.roles": "broker,controller",
        "node.id": config.node_id,
        # A static quorum (one voter, or the cluster's): no dynamic-quorum bootstrap needed at format time.
        "controller.quorum.voters": ",".join(config.quorum) or config.voter,
        "listeners": f"PLAINTEXT://{config.host}:{config.port},CONTROLLER://{config.host}:{config.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{config.host}:{config.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(config.data_dir),
        "num.partitions": 1,
        "auto.create.topics.enable": "false",  # topics come from the registry (admin.ensure_topics), never by typo
        # The largest event must pass every limit on its way: the batch limit, replica fetches, and one
        # produce request holding it (socket.request.max.bytes, 100 MiB by default, kept at least that).
        "message.max.bytes": batch_limit,
        "replica.fetch.max.bytes": batch_limit,
        "socket.request.max.bytes": max(100 * 1024 * 1024, 4 * batch_limit),
        # Internal topics (consumer offsets, transactions, share groups) with as many replicas as the cluster
        # has, up to three (one node: 1, so that consumer groups and transactional producers work at all);
        # 8 partitions each so that they are created fast.
        "offsets.topic.replication.factor": config.replicas,
        "offsets.topic.num.partitions": 8,
        "transaction.state.log.replication.factor": config.replicas,
        "transaction.state.log.min.isr": config.min_insync_replicas,
        "transaction.state.log.num.partitions": 8,
        "share.coordinator.state.topic.replication.factor": config.replicas,
        "share.coordinator.state.topic.min.isr": config.min_insync_replicas,
        "share.coordinator.state.topic.num.partitions": 8,
        # Topics created without these (a Faust changelog) get the cluster's replication; an out-of-sync
        # replica never becomes leader (Kafka's default, stated: it would drop acknowledged writes).
        "default.replication.factor": config.replicas,
        "min.insync.replicas": config.min_insync_replicas,
        "unclean.leader.election.enable": "false",
        # Tests and the CLI form groups often; do not hold the first rebalance back (default 3 s).
        "group.initial.rebalance.delay.ms": 0,
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def new_cluster_id() -> str:
    """A random Kafka cluster id: 16 random bytes in unpadded URL-safe base64, as ``kafka-storage random-uuid``."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _is_our_broker(pid: int, properties: Path) -> bool:
    """Whether ``pid`` is alive and is a ``kafka.Kafka`` JVM started on ``properties`` (not a reused pid)."""
    if Path("/proc/self/cmdline").exists():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()  # empty for a zombie
        except OSError:
            return False
        return b"kafka.Kafka" in cmdline and os.fsencode(properties) in cmdline
    try:  # no /proc (macOS): trust the pid file
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class KafkaBroker:
    """Start, stop and inspect the local broker described by a :class:`KafkaConfig`."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        self.pid_file = config.home / "broker.pid"
        self.log_file = config.home / "logs" / "broker.log"
        self.properties_file = config.home / "server.properties"
        self._process: subprocess.Popen[bytes] | None = None

    def ensure_distribution(self) -> Path:
        """The broker's jar folder, resolved through Maven on first use; checks for Java 17+ first."""
        require_java()
        return resolve_kafka(self.config.version, self.config.cache_dir)

    def pid(self) -> int | None:
        """The broker's pid if the process in the pid file is alive and is this home's broker."""
        try:
            pid = int(self.pid_file.read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            return None
        return pid if _is_our_broker(pid, self.properties_file) else None

    def is_running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout_s: float = 120) -> None:
        """Start the broker unless it runs already; return once it answers Kafka requests.

        Resolves the jars and formats the storage on first use (not counted in ``timeout_s``). Raises
        BrokerStartError (with the log's last 40 lines) if the broker dies or does not answer within
        ``timeout_s``; a broker that this call launched is then stopped.
        """
        self.config.home.mkdir(parents=True, exist_ok=True)
        with file_lock(self.config.home / ".start.lock"):  # two starts on one home would race on the pid file
            if self.is_running():  # started by someone else, perhaps still starting: wait for it
                self._await_answer(None, time.monotonic() + timeout_s, timeout_s)
                return
            self.pid_file.unlink(missing_ok=True)
            libs = self.ensure_distribution()
            self._check_ports_free()
            self._write_config()
            self._format_storage(libs)
            self._launch(libs)
            self._await_answer(self._process, time.monotonic() + timeout_s, timeout_s)

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the broker: SIGTERM (a clean shutdown), then SIGKILL after ``timeout_s``. Safe to repeat."""
        pid = self.pid()
        if pid is not None:
            self._signal(pid, signal.SIGTERM)
            if not self._wait_gone(pid, timeout_s):
                self._signal(pid, signal.SIGKILL)
                if not self._wait_gone(pid, 10):
                    raise BrokerStopError(f"Kafka (pid {pid}) outlived SIGKILL; check `ps -p {pid}`")
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the broker (no clean shutdown: what a crash or a lost host does); for failover tests."""
        pid = self.pid()
        if pid is not None:
            self._signal(pid, signal.SIGKILL)
            if not self._wait_gone(pid, 10):
                raise BrokerStopError(f"Kafka (pid {pid}) outlived SIGKILL; check `ps -p {pid}`")
        self.pid_file.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        """What ``rollwire status`` reports about this broker (no network request)."""
        pid = self.pid()
        return {"running": pid is not None, "pid": pid, "node_id": self.config.node_id,
                "bootstrap": self.config.bootstrap,
                "version": self.config.version, "data_dir": str(self.config.data_dir),
                "log": str(self.log_file)}

    def _java_command(self, libs: Path, main_class: str, *args: str) -> list[str]:
        return [require_java(), *self.config.heap.split(), *_JVM_FLAGS,
                f"-Dlog4j2.configurationFile={self.config.home / 'log4j2.xml'}",
                "-cp", f"{libs}/*", main_class, *args]

    def _check_ports_free(self) -> None:
        for port in (self.config.port, self.config.controller_port):
            with socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Kafka binds: TIME_WAIT is fine
                try:
                    probe.bind((self.config.host, port))
                except OSError as exc:
                    raise BrokerStartError(
                        f"cannot listen on {self.config.host}:{port} ({exc.strerror}): another process uses it; "
                        "stop it, or set ROLLWIRE_KAFKA_PORT to a free port (the controller takes the next)"
                    ) from exc

    def _write_config(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        if self.log_file.exists() and self.log_file.stat().st_size > _ROTATE_LOG_BYTES:
            self.log_file.replace(self.log_file.with_name("broker.log.1"))
        self.properties_file.write_text(server_properties(self.config), encoding="utf-8")
        (self.config.home / "log4j2.xml").write_text(template("log4j2.xml"), encoding="utf-8")

    def _format_storage(self, libs: Path) -> None:
        if (self.config.data_dir / "meta.properties").exists():
            return
        cluster_id = self.config.cluster_id or new_cluster_id()
        # "--cluster-id=ID" in one argument: a base64 id may start with "-" and read as an option.
        command = self._java_command(libs, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
                                     f"--config={self.properties_file}")
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as exc:
            raise BrokerStartError(f"formatting {self.config.data_dir} took over 120 s") from exc
        if result.returncode != 0:
            output = (result.stdout + result.stderr).strip().splitlines()[-40:]
            raise BrokerStartError(f"formatting Kafka storage in {self.config.data_dir} failed "
                                   f"(exit {result.returncode}); empty that folder if it holds an old "
                                   "broker's data:\n" + "\n".join(output))

    def _launch(self, libs: Path) -> None:
        command = self._java_command(libs, "kafka.Kafka", str(self.properties_file))
        with open(self.log_file, "ab") as log:
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             cwd=self.config.home, start_new_session=True)
        self.pid_file.write_text(f"{self._process.pid}\n", encoding="utf-8")

    def _await_answer(self, process: subprocess.Popen[bytes] | None, deadline: float, timeout_s: float) -> None:
        while True:
            if process is not None and process.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise BrokerStartError(f"Kafka exited with code {process.returncode} while starting; last lines "
                                       f"of {self.log_file}:\n{self._log_tail()}")
            if process is None and not self.is_running():
                raise BrokerStartError(f"Kafka (pid file {self.pid_file}) died while starting; last lines of "
                                       f"{self.log_file}:\n{self._log_tail()}")
            remaining = deadline - time.monotonic()
            if broker_answers(self.config.bootstrap, timeout_s=max(0.5, min(2.0, remaining))):
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if process is not None:
            self.stop()
        raise BrokerStartError(f"Kafka did not answer at {self.config.bootstrap} within {timeout_s:.0f} s; last "
                               f"lines of {self.log_file}:\n{self._log_tail()}")

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        try:
            if os.getpgid(pid) == pid:  # started with its own session: signal the whole group
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError as exc:
            raise BrokerStopError(f"not allowed to signal Kafka (pid {pid}); stop it as the user who started "
                                  "it") from exc

    def _wait_gone(self, pid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.pid == pid:
                self._process.poll()  # reap our own child, or it lingers as a zombie
            if not _is_our_broker(pid, self.properties_file):
                return True
            time.sleep(0.1)
        return False

    def _log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_file, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 256 * 1024))
                text = log.read().decode("utf-8", errors="replace")
        except OSError:
            return "(no log output)"
        return "\n".join(text.splitlines()[-lines:]) or "(no log output)"
