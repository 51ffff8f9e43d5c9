"""Bringing up the stack: one routine per part, each reusing what already answers or starting it.

The parts, bottom up: the broker, its topics, the engine, the proxy (one process, or a tier of several
behind HAProxy: :func:`proxy_tier`), the trajectory worker (processors),
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
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx

from deploy.engine.server import EngineConfig, VllmServer, engine_ready
from deploy.engine.tiny_model import build_tiny_model
from deploy.engine.vllm_env import ensure_vllm_env
from proxy.fleet.entries import PoolConfigError, parse_entries
from deploy.errors import DeployError
from deploy.kafka import KafkaBroker, KafkaConfig
from deploy.kafka_cluster import KafkaCluster
from deploy.proxy_front import FRONT_NAME, HEALTH_PATH, STATS_PATH, Backend, backends_spec, haproxy_binary, member_name
from deploy.services import ServiceProcess
from deploy.settings import ProxyTierSettings
from schemas import paths
from schemas.admin_token import ADMIN_TOKEN_VARIABLE, ensure_admin_token
from schemas.transport.admin import ExtraTopic, broker_answers, ensure_topics
from schemas.transport.settings import KafkaSettings
from sinks.ui.settings import UiSettings

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


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive free ports (a pool's embedded engines listen side by side)."""
    for _ in range(100):
        first = free_port(host)
        if first + count - 1 <= 65535 and all(_port_free(host, first + i) for i in range(count)):
            return first
    raise StackError(f"no {count} consecutive free ports on {host}")


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


@dataclass(frozen=True)
class EngineEntry:
    """One engine of a pool: its id (stable across restarts: a configured name, else its URL) and URL."""

    name: str
    url: str

    @property
    def spec(self) -> str:
        """The entry as ``ROLLWIRE_ENGINE_URLS`` and a pool file write it: ``NAME=URL``, or the URL alone."""
        return self.url if self.name == self.url else f"{self.name}={self.url}"


def parse_engine_entries(text: str, *, source: str = "ROLLWIRE_ENGINE_URLS") -> list[EngineEntry]:
    """Engines written as the proxy reads them (``proxy.fleet.entries``): separated by commas or lines, each
    ``URL`` or ``NAME=URL``; no text, no engines. A malformed entry fails naming ``source``."""
    if not any(line.split("#", 1)[0].strip(" ,") for line in text.splitlines()):
        return []
    try:
        return [EngineEntry(entry.id, entry.url) for entry in parse_entries(text, source)]
    except PoolConfigError as exc:
        raise StackError(exc.message) from exc


def external_engines() -> list[EngineEntry] | None:
    """The engines the user named: ``ROLLWIRE_ENGINE_URLS`` (which takes precedence), else
    ``ROLLWIRE_ENGINE_URL``; None for the embedded ones."""
    pool = os.environ.get("ROLLWIRE_ENGINE_URLS", "").strip()
    if pool:
        entries = parse_engine_entries(pool)
        if not entries:
            raise StackError("ROLLWIRE_ENGINE_URLS names no engine")
        return entries
    url = external_engine_url()
    return [EngineEntry(url.rstrip("/"), url.rstrip("/"))] if url else None


def engine_name(index: int) -> str:
    """The id of the ``index``-th embedded engine, as completion events and metrics name it."""
    return f"engine-{index}"


def engine_configs(count: int, base: EngineConfig | None = None) -> list[EngineConfig]:
    """``count`` embedded engines: ``base`` (default :func:`engine_config`) on its port, the others on the
    ports after it, each with its own home. The first keeps ``base``'s home (``$ROLLWIRE_HOME/engine``),
    so a single engine is where it always was and a stack grown from one engine to several reuses it; the
    ``i``-th (``i`` ≥ 1) lives in ``engine-<i>`` beside it. Several engines each get a core of their own
    (round the machine's cores): left to vLLM, every engine's worker binds to the same first core and the
    engines take turns on it unevenly (``bench.engines --shared-core`` shows it)."""
    if count < 1:
        raise StackError(f"--engines {count}: at least one engine is needed")
    base = base or engine_config()
    if base.port + count - 1 > 65535:
        raise StackError(f"{count} engines from port {base.port} run past 65535; lower ROLLWIRE_ENGINE_PORT")
    if count == 1:
        return [base]
    cores = os.cpu_count() or 1
    return [dataclasses.replace(base, cpu_cores=str(i % cores)) if i == 0 else
            dataclasses.replace(base, port=base.port + i, home=base.home.parent / f"{base.home.name}-{i}",
                                cpu_cores=str(i % cores))
            for i in range(count)]


def pool_record(home: Path | None = None) -> Path:
    """Where ``rollwire up`` writes the embedded engines it brought up, one ``NAME=URL`` a line (the
    format of ``ROLLWIRE_ENGINE_POOL_FILE``): how ``status`` and ``down`` find every one of them."""
    return (home or paths.home()) / "engine-pool"


def write_pool_record(entries: Sequence[EngineEntry], home: Path | None = None) -> Path:
    path = pool_record(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{entry.spec}\n" for entry in entries), encoding="utf-8")
    return path


def recorded_engine_configs(base: EngineConfig | None = None, home: Path | None = None) -> list[EngineConfig]:
    """The embedded engines the last ``rollwire up`` brought up (its pool record), as configurations:
    as many as it recorded, at least the default one."""
    try:
        count = len(parse_engine_entries(pool_record(home).read_text(encoding="utf-8"), source="the pool record"))
    except (OSError, StackError):
        count = 1
    return engine_configs(max(count, 1), base)


def engine(external_url: str | None, config: EngineConfig, *, timeout_s: float = 1800,
           on_start: Callable[[], None] | None = None, name: str = "engine") -> Part:
    """An external engine (``ROLLWIRE_ENGINE_URL``) must answer /v1/models; else the embedded vLLM CPU
    server of ``config`` is reused if ready, or started (``on_start`` is called first: the first start
    installs vLLM's CPU build)."""
    if external_url is not None:
        url = external_url.rstrip("/")
        if not answers(f"{url}/v1/models"):
            raise StackError(f"the engine at ROLLWIRE_ENGINE_URL={external_url} does not answer /v1/models")
        return Part(name, "reused", url)
    server = VllmServer(config)
    if engine_ready(server.url, config.served_model_name):
        return Part(name, "reused", server.url)
    if on_start is not None:
        on_start()
    server.start(timeout_s=timeout_s)
    return Part(name, "started", server.url, stop=server.stop)


def engines(external: Sequence[EngineEntry] | None, configs: Sequence[EngineConfig], *, timeout_s: float = 1800,
            on_start: Callable[[], None] | None = None) -> list[Part]:
    """The pool the proxy serves from, one :class:`Part` per engine named by its id (``Part.name``).

    External engines (:func:`external_engines`) must each answer /v1/models. Else the embedded engines of
    ``configs`` (:func:`engine_configs`): each reused if ready, the others started side by side (vLLM's
    environment and the tiny model are prepared once first, ``on_start`` called before that). When one
    fails to start, those this call started are stopped again and the error names it."""
    if external is not None:
        silent = [entry for entry in external if not answers(f"{entry.url}/v1/models")]
        if silent:
            raise StackError("these engines do not answer /v1/models: "
                             + ", ".join(entry.spec for entry in silent))
        return [Part(entry.name, "reused", entry.url) for entry in external]
    servers = [VllmServer(config) for config in configs]
    ready = [engine_ready(server.url, server.config.served_model_name) for server in servers]
    if not all(ready):
        if on_start is not None:
            on_start()
        first = next(server for server, up in zip(servers, ready) if not up)
        ensure_vllm_env(first.config.cache_dir)
        build_tiny_model(first.config.model_dir, seed=first.config.seed)
    errors: dict[int, BaseException] = {}

    def start(index: int) -> None:
        try:
            servers[index].start(timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the engine's name
            errors[index] = exc

    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i, up in enumerate(ready) if not up]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for index, up in enumerate(ready):
            if not up and index not in errors:
                servers[index].stop()
        index, exc = min(errors.items())
        raise StackError(f"{engine_name(index)} ({servers[index].url}) did not start: {exc}") from exc
    return [Part(engine_name(i), "reused" if up else "started", server.url,
                 stop=None if up else server.stop)
            for i, (server, up) in enumerate(zip(servers, ready))]


def pool_env(parts: Sequence[Part]) -> dict[str, str]:
    """What tells a proxy to serve ``parts``: ``ROLLWIRE_ENGINE_URLS`` naming each (``NAME=URL``), and
    ``ROLLWIRE_ENGINE_URL`` the first (for a reader of the single engine)."""
    entries = [EngineEntry(part.name, part.address) for part in parts]
    return {"ROLLWIRE_ENGINE_URLS": ",".join(entry.spec for entry in entries),
            "ROLLWIRE_ENGINE_URL": entries[0].url}


def engine_states(parts: Sequence[EngineEntry], proxy_url: str | None = None,
                  admin_token: str | None = None) -> list[dict[str, object]]:
    """Per engine: its id, URL and whether it answers /health; with ``proxy_url`` (a proxy that answers),
    what the proxy's ``GET /v1/engines`` says of it (in-flight calls, version, prefix-cache hit rate...)."""
    seen: dict[str, dict[str, object]] = {}
    if proxy_url is not None:
        headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        try:
            response = httpx.get(f"{proxy_url}/v1/engines", headers=headers, timeout=3)
            listed = response.json() if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            listed = []
        if isinstance(listed, dict):  # an envelope around the list
            listed = listed.get("engines") or listed.get("data") or []
        for row in listed if isinstance(listed, list) else []:
            if isinstance(row, dict):
                seen[str(row.get("id"))] = row
                seen.setdefault(str(row.get("url", "")).rstrip("/"), row)
    states = []
    for entry in parts:
        state: dict[str, object] = {"id": entry.name, "url": entry.url, "healthy": answers(f"{entry.url}/health")}
        row = seen.get(entry.name) or seen.get(entry.url)
        if row is not None:
            state.update({f"proxy_{key}": value for key, value in row.items() if key not in ("id", "url")})
        states.append(state)
    return states


# ---- rollwire's own services --------------------------------------------------------------------------


def _service(name: str, args: tuple[str, ...], where: Port | None, env: dict[str, str], *,
             timeout_s: float, health_path: str = "/health", kind: str | None = None) -> Part:
    """Reuse or start one detached ``rollwire`` service. With ``where``, it is reused when its health URL
    answers; without, when its pid file names a live process (a service with no HTTP port). ``kind`` names
    the service whose port variables it reads (default ``name``: a tier's ``proxy-1`` is a ``proxy``)."""
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
                             env={**env, **_port_env(kind or name, where.host, port)})
    service.start(timeout_s=timeout_s)
    return Part(name, "started", f"http://{where.host}:{port}", stop=service.stop)


_PORT_VARIABLES: dict[str, tuple[str, str]] = {
    "proxy": ("ROLLWIRE_PROXY_HOST", "ROLLWIRE_PROXY_PORT"),
    "processors": ("ROLLWIRE_PROCESSORS_HOST", "ROLLWIRE_PROCESSORS_PORT"),
    "rollout-server": ("ROLLWIRE_ROLLOUT_HOST", "ROLLWIRE_ROLLOUT_PORT"),
    "gateway-node": ("ROLLWIRE_GATEWAY_HOST", "ROLLWIRE_GATEWAY_PORT"),
    "groups": ("ROLLWIRE_GROUPS_HOST", "ROLLWIRE_GROUPS_PORT"),
    "ui": ("ROLLWIRE_UI_HOST", "ROLLWIRE_UI_PORT"),
    FRONT_NAME: ("ROLLWIRE_PROXY_HOST", "ROLLWIRE_PROXY_STATS_PORT"),
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


def proxy(kafka: KafkaSettings, engine_url: str | Sequence[Part], where: Port, *, timeout_s: float = 120,
          env: dict[str, str] | None = None) -> Part:
    """The gateway proxy in front of ``engine_url``, or of a pool of engines (:func:`engines`' parts, named
    to it by :func:`pool_env`); ``env`` adds to its environment (``ROLLWIRE_ENGINE_PLACEMENT``...)."""
    proxy_env = _proxy_env(kafka, engine_url, env)
    return _service("proxy", ("proxy", "--engine-url", proxy_env["ROLLWIRE_ENGINE_URL"]), where, proxy_env,
                    timeout_s=timeout_s)


def _proxy_env(kafka: KafkaSettings, engine_url: str | Sequence[Part], env: dict[str, str] | None) -> dict[str, str]:
    """What a proxy process needs: the topics, its engines, the admin token and ``env``."""
    engine_env = ({"ROLLWIRE_ENGINE_URL": engine_url} if isinstance(engine_url, str)
                  else pool_env(engine_url))
    # The operator's endpoints (sessions, weights) take the deployment's admin token: a harness reaches
    # this proxy too (schemas/admin_token.py).
    return {**_kafka_env(kafka), **engine_env, ADMIN_TOKEN_VARIABLE: ensure_admin_token(), **(env or {})}


# ---- the proxy tier: several proxy processes behind HAProxy --------------------------------------------


@dataclass(frozen=True)
class ProxyTier:
    """The proxy as a bring-up left it: one process, or several behind the front (HAProxy)."""

    processes: tuple[Part, ...]
    front: Part | None = None
    """HAProxy on the proxy's address; None for a single process, which listens there itself."""
    stats_url: str | None = None
    """The front's stats page."""

    @property
    def entry(self) -> Part:
        """Where harnesses and gateway nodes reach the proxy: the front, else the one process."""
        return self.front or self.processes[0]

    @property
    def parts(self) -> tuple[Part, ...]:
        """Every part, the front last."""
        return (*self.processes, *((self.front,) if self.front is not None else ()))


@dataclass(frozen=True)
class TierRecord:
    """A tier as its bring-up wrote it down (``$ROLLWIRE_HOME/proxy-tier.json``): how ``status`` and ``down``
    find its processes and its front, and how a later bring-up reuses them where they are."""

    url: str
    """The front's address (the proxy's URL)."""
    stats_url: str
    """The front's stats page."""
    processes: tuple[tuple[str, str], ...]
    """Each process's name and URL."""


def tier_record_path(home: Path | None = None) -> Path:
    return (home or paths.home()) / "proxy-tier.json"


def write_tier_record(record: TierRecord, home: Path | None = None) -> Path:
    path = tier_record_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": record.url, "stats_url": record.stats_url,
                                "processes": [{"name": n, "url": u} for n, u in record.processes]}, indent=1) + "\n",
                    encoding="utf-8")
    return path


def read_tier_record(home: Path | None = None) -> TierRecord | None:
    """The tier the last bring-up of several proxy processes recorded, or None (none, or unreadable)."""
    try:
        data = json.loads(tier_record_path(home).read_text(encoding="utf-8"))
        return TierRecord(str(data["url"]), str(data["stats_url"]),
                          tuple((str(p["name"]), str(p["url"])) for p in data["processes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget_tier(home: Path | None = None) -> None:
    tier_record_path(home).unlink(missing_ok=True)


_MEMBER_FOLDER = re.compile(r"proxy-\d+")


def tier_services(home: Path | None = None) -> tuple[ServiceProcess, list[ServiceProcess]]:
    """Handles on the tier's front and on each of its processes: those recorded, and any other ``proxy-<i>``
    whose pid file is under the home (a bring-up that failed half way), for ``down`` and ``status``."""
    home = home or paths.home()
    record = read_tier_record(home)
    urls = dict(record.processes) if record is not None else {}
    names = set(urls) | {path.name for path in home.glob("proxy-*")
                         if _MEMBER_FOLDER.fullmatch(path.name) and (path / f"{path.name}.pid").is_file()}
    front_health = f"{record.stats_url.rsplit('/', 1)[0]}{HEALTH_PATH}" if record is not None else None
    members = [ServiceProcess(name=name, args=(), home=home,
                              health_url=f"{urls[name]}/health" if name in urls else None)
               for name in sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))]
    return ServiceProcess(name=FRONT_NAME, args=(), health_url=front_health, home=home), members


def proxy_tier(kafka: KafkaSettings, engine_url: str | Sequence[Part], where: Port, tier: ProxyTierSettings, *,
               timeout_s: float = 120, env: dict[str, str] | None = None) -> ProxyTier:
    """The proxy at ``where``: with ``tier.count`` 1, :func:`proxy` (one process, nothing else changes);
    with more, that many ``rollwire proxy`` processes (``proxy-<i>``, each its ``ROLLWIRE_PROXY_INSTANCE``, on
    ``tier.tier_port`` + i, all with the same engines, Kafka and admin token), started side by side, and
    ``rollwire proxy-front`` (HAProxy, deploy/proxy_front.py) on ``where`` in front of them, its stats on
    ``tier.stats_port``. A running tier is reused (its dead processes started again where the front expects
    them); a single proxy of this home running at ``where``, or a running tier of another size, fails with
    what to do. The tier is recorded for ``status`` and ``down`` (:class:`TierRecord`)."""
    if tier.count == 1:
        return ProxyTier((proxy(kafka, engine_url, where, timeout_s=timeout_s, env=env),))
    haproxy_binary()
    recorded = read_tier_record()
    front_service, _ = tier_services()
    front_running = recorded is not None and front_service.pid() is not None
    if recorded is not None and front_running:
        if len(recorded.processes) != tier.count:
            raise StackError(f"the proxy tier at {recorded.url} runs {len(recorded.processes)} processes, not "
                             f"{tier.count}: run `rollwire down`, then bring it up again with --proxies {tier.count}")
        public = _url_port(recorded.url)
        stats = Port(where.host, _url_port(recorded.stats_url))
        ports = [Port(where.host, _url_port(url)) for _, url in recorded.processes]
    else:
        public = _front_port(where)
        stats = Port(where.host, tier.stats_port, move_if_taken=where.move_if_taken)
        known = dict(recorded.processes) if recorded is not None else {}
        ports = [Port(where.host, _url_port(known[member_name(i)]) if member_name(i) in known else tier.tier_port + i,
                      move_if_taken=True) for i in range(tier.count)]
    proxy_env = _proxy_env(kafka, engine_url, env)
    processes = _tier_processes(proxy_env, ports, timeout_s)
    if front_running:
        # Its configuration names the processes where they were restarted; its checks bring them back in.
        front = Part(FRONT_NAME, "reused", f"http://{stats.host}:{stats.port}")
    else:
        front_env = {**(env or {}), "ROLLWIRE_PROXY_PORT": str(public), "ROLLWIRE_PROXY_BACKENDS": backends_spec(
            [Backend(part.name, where.host, _url_port(part.address)) for part in processes])}
        try:
            front = _service(FRONT_NAME, ("proxy-front",), stats, front_env, timeout_s=timeout_s,
                             health_path=HEALTH_PATH)
        except DeployError:
            for part in processes:
                if part.stop is not None:
                    part.stop()
            raise
    url = f"http://{where.host}:{public}"
    stats_url = f"{front.address}{STATS_PATH}"
    write_tier_record(TierRecord(url, stats_url, tuple((part.name, part.address) for part in processes)))
    return ProxyTier(processes, Part(FRONT_NAME, front.state, url, stop=front.stop), stats_url)


def _url_port(url: str) -> int:
    port = urlsplit(url).port
    if port is None:
        raise StackError(f"{url} names no port")
    return port


def _front_port(where: Port) -> int:
    """The port the front takes: ``where``'s, unless something holds it (a proxy of this home running alone
    fails; anything else moves the front to a free port with ``move_if_taken``, else fails)."""
    if _port_free(where.host, where.port):
        return where.port
    url = f"http://{where.host}:{where.port}"
    if ServiceProcess(name="proxy", args=(), health_url=None).pid() is not None:
        raise StackError(f"one proxy process of this stack already listens at {url}: run `rollwire down`, then "
                         "bring up the tier of several")
    if not where.move_if_taken:
        raise StackError(f"something else holds {url}, where the proxy tier's front would listen: stop it, or "
                         "set ROLLWIRE_PROXY_PORT")
    return free_port(where.host)


def _tier_processes(env: dict[str, str], ports: Sequence[Port], timeout_s: float) -> tuple[Part, ...]:
    """The tier's processes at ``ports``, each reused if it answers, else started, side by side; when one
    fails to start, those this call started are stopped again and the error names it."""
    parts: dict[int, Part] = {}
    errors: dict[int, BaseException] = {}

    def bring_up(index: int) -> None:
        name = member_name(index)
        try:
            parts[index] = _service(name, ("proxy", "--engine-url", env["ROLLWIRE_ENGINE_URL"]), ports[index],
                                    {**env, "ROLLWIRE_PROXY_INSTANCE": name}, timeout_s=timeout_s, kind="proxy")
        except BaseException as exc:  # noqa: BLE001 - reported below, with the process's name
            errors[index] = exc

    threads = [threading.Thread(target=bring_up, args=(i,), daemon=True) for i in range(len(ports))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for part in parts.values():
            if part.stop is not None:
                part.stop()
        index, exc = min(errors.items())
        raise StackError(f"{member_name(index)} did not start: {exc}") from exc
    return tuple(parts[i] for i in range(len(ports)))


def processors(kafka: KafkaSettings, where: Port, *, timeout_s: float = 180) -> Part:
    """A trajectory worker (Faust): completions and session events → trajectories."""
    return _service("processors", ("processors",), where, _kafka_env(kafka), timeout_s=timeout_s)


def rollout_server(kafka: KafkaSettings, where: Port, *, timeout_s: float = 120) -> Part:
    """The rollout server: tasks → sessions on Kafka, status, callbacks."""
    return _service("rollout-server", ("rollout-server",), where, _kafka_env(kafka), timeout_s=timeout_s)


def gateway_node(kafka: KafkaSettings, proxy_url: str, where: Port | None, *, timeout_s: float = 120,
                 engine_url: str | None = None) -> Part:
    """A gateway node running sessions' harnesses against ``proxy_url`` (``where`` None: no health port);
    with ``engine_url`` it asks the engine's health to tell an engine outage from a harness's failure."""
    env = {**_kafka_env(kafka), "ROLLWIRE_GATEWAY_PROXY_URL": proxy_url}
    if engine_url:
        env["ROLLWIRE_GATEWAY_ENGINE_URL"] = engine_url
    if where is None:
        env["ROLLWIRE_GATEWAY_PORT"] = "0"
    return _service("gateway-node", ("gateway-node",), where, env, timeout_s=timeout_s)


def evaluator(kafka: KafkaSettings, name: str, *, timeout_s: float = 3, env: dict[str, str] | None = None) -> Part:
    """An evaluator worker (``rollwire evaluator run NAME``); it has no HTTP port, so it counts as started
    once it stays alive ``ServiceProcess.settle_s``. ``env``: more variables for it (the judge's engine)."""
    return _service(f"evaluator-{name}", ("evaluator", "run", name), None, {**_kafka_env(kafka), **(env or {})},
                    timeout_s=timeout_s)


def groups(kafka: KafkaSettings, where: Port, *, timeout_s: float = 180) -> Part:
    """The groups worker (Faust): trajectories + evaluations + tasks → GRPO groups."""
    return _service("groups", ("groups",), where, _kafka_env(kafka), timeout_s=timeout_s)


def ui_port() -> Port:
    """Where the web page listens: ROLLWIRE_UI_HOST / ROLLWIRE_UI_PORT (127.0.0.1:8790)."""
    settings = UiSettings()
    return Port(settings.host, settings.port)


def ui_tokenizer() -> str | None:
    """The vocabulary the trace page decodes with: the embedded engine's model when it serves (an external
    engine's is unknown here: ROLLWIRE_UI_TOKENIZER names it, else the UI uses the Qwen vocabulary)."""
    configured = UiSettings().tokenizer
    if configured:
        return configured
    if external_engines() is None:
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


def harnesses(names: Sequence[str], *, say: Callable[[str], None] = print) -> Part:
    """The harness CLIs ``names`` installed on this machine before any session needs them
    (producers/harness_install.py: one install per CLI, under a lock that the gateway nodes' own calls wait
    on), with npm's progress going to ``say``: a first install takes minutes, and the user watches the job's
    output, not the gateway node's log. Names that are no npm CLI (``command``) are passed over. Raises
    DeployError naming the CLI that could not be installed."""
    from producers.harness_install import HARNESSES, HarnessInstallError, ensure_harness, harness_prefix

    wanted = sorted({name for name in names if name in HARNESSES})
    installed = False
    for name in wanted:
        was_there = harness_prefix(name).is_dir()
        try:
            ensure_harness(name, progress=say)
        except HarnessInstallError as exc:
            raise DeployError(f"harness {name} could not be installed: {exc}") from exc
        installed = installed or not was_there
    # Nothing runs that the job would stop (no stop routine): "started" says npm installed one now.
    return Part("harnesses", "started" if installed else "reused",
                ", ".join(str(harness_prefix(name)) for name in wanted) or "none needed")
