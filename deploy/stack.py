"""Bringing up the stack: one routine per part, each reusing what already answers or starting it.

The parts, bottom up: the broker, its topics, the engine, the proxy, the trajectory worker (processors),
the rollout server, a gateway node, the evaluators and the groups worker; and, for sessions in containers,
the Docker engine with the images they run. ``rollwire up``, the main job
(deploy/job.py) and the tests' fixtures all bring parts up through these routines, so a part is reused,
started and addressed the same way everywhere. Each routine returns a :class:`Part` saying whether it was
reused or started, where it answers, and (when this call started it) how to stop it.

Ports: a routine takes the port its part should listen on. With ``move_if_taken`` a port that something
else holds (and that does not answer as the part) is replaced by a free one; otherwise starting there
fails with the reason. The chosen port reaches the started process through its own environment, never
through this process's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from deploy.engine.server import EngineConfig, VllmServer, engine_ready
from deploy.errors import DeployError
from deploy.kafka import KafkaBroker, KafkaConfig
from deploy.kafka_cluster import KafkaCluster
from deploy.services import ServiceProcess
from schemas.admin_token import ADMIN_TOKEN_VARIABLE, ensure_admin_token
from schemas.transport.admin import ExtraTopic, broker_answers, ensure_topics
from schemas.transport.settings import KafkaSettings
from schemas.ui_links import DEFAULT_UI_PORT

PartState = Literal["reused", "started"]


class StackError(DeployError):
    """A part of the stack could not be reused or started."""


@dataclass(frozen=True)
class Part:
    """One part of the stack as a routine left it."""

    name: str
    state: PartState
    address: str
    """Where it answers: a bootstrap list, a URL, or a log file for a part without an HTTP port."""
    stop: Callable[[], None] | None = None
    """Stops the part; set only when this call started it."""
    created: tuple[str, ...] = ()
    """What starting it created (the topics' names)."""

    @property
    def started(self) -> bool:
        return self.state == "started"


@dataclass(frozen=True)
class Port:
    """Where a part listens: the host, the port, and whether a taken port may move to a free one."""

    host: str
    port: int
    move_if_taken: bool = False


def answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` answers a GET with 200."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# ---- Kafka --------------------------------------------------------------------------------------------


def local_cluster(config: KafkaConfig, brokers: int | None = None) -> KafkaCluster | None:
    """The project's own multi-node cluster under ``config.home``: the one a start laid out there (its
    ``cluster.json``), else a new one of ``brokers`` nodes; None for the single development broker."""
    found = KafkaCluster.load(config)
    if found is not None:
        if brokers is not None and brokers != len(found.nodes):
            raise StackError(f"{config.home} holds a {len(found.nodes)}-broker cluster, not {brokers}: run "
                             f"`rollwire down`, then remove {found.layout_file} and the node-* folders beside it "
                             "(their data is lost), or set ROLLWIRE_HOME to another folder")
        return found
    return KafkaCluster(config, brokers) if brokers is not None and brokers > 1 else None


def managed_settings(config: KafkaConfig, settings: KafkaSettings | None = None,
                     cluster: KafkaCluster | None = None) -> KafkaSettings:
    """Kafka settings pointing at the project's own broker (or its local ``cluster``, default: the one laid
    out under ``config.home``, with its replication) unless ROLLWIRE_KAFKA_BOOTSTRAP names another."""
    settings = settings or KafkaSettings()
    if "kafka_bootstrap" in settings.model_fields_set:
        return settings
    cluster = cluster or KafkaCluster.load(config)
    if cluster is not None:
        return cluster.settings(settings)
    return settings.model_copy(update={"kafka_bootstrap": config.bootstrap})


def broker(config: KafkaConfig, bootstrap: str | None = None, *, brokers: int | None = None,
           timeout_s: float = 300) -> Part:
    """Reuse the cluster at ``bootstrap`` if it answers; else start the project's broker of ``config`` (or
    its local cluster, :func:`local_cluster`) when ``bootstrap`` is None or is its address. Another address
    that does not answer fails."""
    cluster = local_cluster(config, brokers)
    own = cluster.bootstrap if cluster is not None else config.bootstrap
    address = bootstrap or own
    if broker_answers(address):
        return Part("kafka", "reused", address)
    if address not in (own, config.bootstrap):
        raise StackError(f"no Kafka answers at ROLLWIRE_KAFKA_BOOTSTRAP={address}")
    if cluster is not None:
        cluster.start(timeout_s=timeout_s)
        return Part("kafka", "started", own, stop=cluster.stop)
    launcher = KafkaBroker(config)
    launcher.start(timeout_s=timeout_s)
    return Part("kafka", "started", address, stop=launcher.stop)


def topics(settings: KafkaSettings, extra: Sequence[ExtraTopic] = ()) -> Part:
    """Create the registry's missing topics (and ``extra``); reused when all of them existed."""
    created = asyncio.run(ensure_topics(settings, extra))
    detail = f"prefix {settings.topic_prefix!r}" + (f", {len(created)} created" if created else "")
    return Part("topics", "started" if created else "reused", detail, created=tuple(created))


# ---- the engine ---------------------------------------------------------------------------------------

DEFAULT_ENGINE_MAX_MODEL_LEN = 32768
"""Harness prompts run to ~16k tokens; the tiny model's KV cache holds 64k at 64 MiB."""


def engine_config() -> EngineConfig:
    """The embedded engine's settings (``ROLLWIRE_ENGINE_*``), with a context that holds a harness's prompt."""
    config = EngineConfig.from_env()
    if "ROLLWIRE_ENGINE_MAX_MODEL_LEN" not in os.environ:
        config = dataclasses.replace(config, max_model_len=DEFAULT_ENGINE_MAX_MODEL_LEN)
    return config


def external_engine_url() -> str | None:
    """The engine the user named (``ROLLWIRE_ENGINE_URL``), or None for the embedded one."""
    return os.environ.get("ROLLWIRE_ENGINE_URL") or None




def engine(external_url: str | None, config: EngineConfig, *, timeout_s: float = 1800,
           on_start: Callable[[], None] | None = None) -> Part:
    """An external engine (``ROLLWIRE_ENGINE_URL``) must answer /v1/models; else the embedded vLLM CPU
    server of ``config`` is reused if ready, or started (``on_start`` is called first: the first start
    installs vLLM's CPU build)."""
    if external_url is not None:
        url = external_url.rstrip("/")
        if not answers(f"{url}/v1/models"):
            raise StackError(f"the engine at ROLLWIRE_ENGINE_URL={external_url} does not answer /v1/models")
        return Part("engine", "reused", url)
    server = VllmServer(config)
    if engine_ready(server.url, config.served_model_name):
        return Part("engine", "reused", server.url)
    if on_start is not None:
        on_start()
    server.start(timeout_s=timeout_s)
    return Part("engine", "started", server.url, stop=server.stop)


# ---- rollwire's own services --------------------------------------------------------------------------


def _service(name: str, args: tuple[str, ...], where: Port | None, env: dict[str, str], *,
             timeout_s: float, health_path: str = "/health") -> Part:
    """Reuse or start one detached ``rollwire`` service. With ``where``, it is reused when its health URL
    answers; without, when its pid file names a live process (a service with no HTTP port)."""
    if where is None:
        detached = ServiceProcess(name=name, args=args, health_url=None, env=env)
        pid = detached.pid()
        if pid is not None:
            return Part(name, "reused", f"pid {pid}")
        detached.start(timeout_s=timeout_s)
        return Part(name, "started", str(detached.log_file), stop=detached.stop)
    port = where.port
    if answers(f"http://{where.host}:{port}{health_path}"):
        return Part(name, "reused", f"http://{where.host}:{port}")
    if where.move_if_taken and not _port_free(where.host, port):
        port = free_port(where.host)
    service = ServiceProcess(name=name, args=args, health_url=f"http://{where.host}:{port}{health_path}",
                             env={**env, **_port_env(name, where.host, port)})
    service.start(timeout_s=timeout_s)
    return Part(name, "started", f"http://{where.host}:{port}", stop=service.stop)


_PORT_VARIABLES: dict[str, tuple[str, str]] = {
    "proxy": ("ROLLWIRE_PROXY_HOST", "ROLLWIRE_PROXY_PORT"),
    "processors": ("ROLLWIRE_PROCESSORS_HOST", "ROLLWIRE_PROCESSORS_PORT"),
    "rollout-server": ("ROLLWIRE_ROLLOUT_HOST", "ROLLWIRE_ROLLOUT_PORT"),
    "gateway-node": ("ROLLWIRE_GATEWAY_HOST", "ROLLWIRE_GATEWAY_PORT"),
    "groups": ("ROLLWIRE_GROUPS_HOST", "ROLLWIRE_GROUPS_PORT"),
    "ui": ("ROLLWIRE_UI_HOST", "ROLLWIRE_UI_PORT"),
}


def _port_env(name: str, host: str, port: int) -> dict[str, str]:
    host_variable, port_variable = _PORT_VARIABLES[name]
    return {host_variable: host, port_variable: str(port)}


def _kafka_env(kafka: KafkaSettings) -> dict[str, str]:
    """What a started service needs to reach the same topics as this process."""
    return {"ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap, "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix,
            "ROLLWIRE_SESSION_PARTITIONS": str(kafka.session_partitions),
            "ROLLWIRE_TASK_PARTITIONS": str(kafka.task_partitions),
            "ROLLWIRE_MAX_MESSAGE_BYTES": str(kafka.max_message_bytes),
            "ROLLWIRE_REPLICATION_FACTOR": str(kafka.replication_factor),
            "ROLLWIRE_MIN_INSYNC_REPLICAS": str(kafka.min_insync_replicas)}


def proxy(kafka: KafkaSettings, engine_url: str, where: Port, *, timeout_s: float = 120) -> Part:
    """The gateway proxy in front of ``engine_url``."""
    # The operator's endpoints (sessions, weights) take the deployment's admin token: a harness reaches
    # this proxy too (schemas/admin_token.py).
    return _service("proxy", ("proxy", "--engine-url", engine_url), where,
                    {**_kafka_env(kafka), "ROLLWIRE_ENGINE_URL": engine_url,
                     ADMIN_TOKEN_VARIABLE: ensure_admin_token()}, timeout_s=timeout_s)


def processors(kafka: KafkaSettings, where: Port, *, timeout_s: float = 180) -> Part:
    """A trajectory worker (Faust): completions and session events → trajectories."""
    return _service("processors", ("processors",), where, _kafka_env(kafka), timeout_s=timeout_s)


def rollout_server(kafka: KafkaSettings, where: Port, *, timeout_s: float = 120) -> Part:
    """The rollout server: tasks → sessions on Kafka, status, callbacks."""
    return _service("rollout-server", ("rollout-server",), where, _kafka_env(kafka), timeout_s=timeout_s)


def gateway_node(kafka: KafkaSettings, proxy_url: str, where: Port | None, *, timeout_s: float = 120) -> Part:
    """A gateway node running sessions' harnesses against ``proxy_url`` (``where`` None: no health port)."""
    env = {**_kafka_env(kafka), "ROLLWIRE_GATEWAY_PROXY_URL": proxy_url}
    if where is None:
        env["ROLLWIRE_GATEWAY_PORT"] = "0"
    return _service("gateway-node", ("gateway-node",), where, env, timeout_s=timeout_s)


def evaluator(kafka: KafkaSettings, name: str, *, timeout_s: float = 3) -> Part:
    """An evaluator worker (``rollwire evaluator run NAME``); it has no HTTP port, so it counts as started
    once it stays alive ``ServiceProcess.settle_s``."""
    return _service(f"evaluator-{name}", ("evaluator", "run", name), None, _kafka_env(kafka), timeout_s=timeout_s)


def groups(kafka: KafkaSettings, where: Port, *, timeout_s: float = 180) -> Part:
    """The groups worker (Faust): trajectories + evaluations + tasks → GRPO groups."""
    return _service("groups", ("groups",), where, _kafka_env(kafka), timeout_s=timeout_s)


def ui_port() -> Port:
    """Where the web page listens: ROLLWIRE_UI_HOST / ROLLWIRE_UI_PORT (127.0.0.1:8790)."""
    return Port(os.environ.get("ROLLWIRE_UI_HOST", "127.0.0.1"),
                int(os.environ.get("ROLLWIRE_UI_PORT", "") or DEFAULT_UI_PORT))


def ui_tokenizer() -> str | None:
    """The vocabulary the trace page decodes with: the embedded engine's model when it serves (an external
    engine's is unknown here: ROLLWIRE_UI_TOKENIZER names it, else the UI uses the Qwen vocabulary)."""
    if os.environ.get("ROLLWIRE_UI_TOKENIZER"):
        return os.environ["ROLLWIRE_UI_TOKENIZER"]
    if external_engine_url() is None:
        model_dir = engine_config().model_dir
        if (model_dir / "tokenizer.json").is_file():
            return str(model_dir)
    return None


def ui(kafka: KafkaSettings, where: Port, *, timeout_s: float = 120) -> Part:
    """The read-only web page over the topics (``rollwire ui``, sinks/ui)."""
    tokenizer = ui_tokenizer()
    env = {**_kafka_env(kafka), **({"ROLLWIRE_UI_TOKENIZER": tokenizer} if tokenizer else {})}
    return _service("ui", ("ui",), where, env, timeout_s=timeout_s)


def docker(instances_file: Path | None = None, *, say: Callable[[str], None] = print) -> Part:
    """The Docker engine the docker runtime's sessions and graders run on (deploy/docker_engine.py: one that
    answers, else rollwire's own dockerd), exported as ``DOCKER_HOST`` for the services started after it,
    and the images they run (deploy/images.py: base, harnesses and ``instances_file``'s instance images),
    each built only when its inputs changed. The engine stays up afterwards, like the broker."""
    from deploy import docker_engine, images

    found = docker_engine.find_engine()
    url = docker_engine.ensure_engine()
    images.build_images(instances_file, say=say)
    return Part("docker", "reused" if found else "started", url)
