"""deploy/compose.yaml's `fleet` profile, read by the Compose CLI itself, and the front's HAProxy configuration.

The fleet is only ever started on a GPU host, so this is where its shape is kept honest: every engine on a GPU
of its own with the flags and environment the embedded engine uses for rollwire's token and weight endpoints,
every proxy process named and serving every engine, behind a front that hashes on the session; every rollwire
service configured only through variables that `rollwire config` lists (a misspelt one would be ignored in
silence), on the `cluster` profile's brokers; and the default and `cluster` services as they were. The front's
configuration is checked by HAProxy and run against two stand-in proxies when HAProxy is installed.

The Compose CLI must be v2 (Debian's docker-compose 1.x refuses the file's top-level `name`): without one the
tests fail and say how to get one (.ci/install-compose builds it from its Go module).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic_settings import BaseSettings

from deploy.cli import app
from deploy.config import variables
from deploy.engine.server import EngineConfig, server_command, server_env
from deploy.engine.vllm_env import VLLM_VERSION
from processors.groups.settings import GroupSettings
from processors.trajectories.settings import ProcessorSettings
from producers.gateway.settings import GatewaySettings
from producers.rollout.settings import RolloutServerSettings
from proxy.settings import ProxySettings
from sinks.ui.settings import UiSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
FRONT_CONFIG = ROOT / "deploy" / "compose" / "haproxy.cfg"
DOCKERFILE = ROOT / "deploy" / "compose" / "rollwire.Dockerfile"
PROFILES = ("--profile", "cluster", "--profile", "fleet")
INSTALL_HINT = ("install Docker's Compose v2 plugin, or build it from its Go module with `bash .ci/install-compose` "
                "(Debian's docker-compose 1.x cannot read this file: it refuses the top-level `name`)")

# What the host sets (compose.yaml's header), to see that it reaches the engines, the proxies and the web page.
MODEL = "/srv/test/model"
CHECKPOINTS = "/srv/test/checkpoints"
SERVED = "test-policy"
HOST_ENV = {"FLEET_MODEL": MODEL, "FLEET_CHECKPOINTS": CHECKPOINTS, "ROLLWIRE_SERVED_MODEL": SERVED}

# The embedded engine's flags and environment that are the CPU build's or the tiny model's, not rollwire's
# (deploy/engine/server.py says why each is there); every other one must be on the fleet's engines too.
CPU_OR_TINY_MODEL_FLAGS = {"--model", "--host", "--port", "--enforce-eager", "--dtype", "--kv-cache-memory-bytes",
                           "--max-num-seqs", "--max-num-batched-tokens", "--chat-template",
                           "--chat-template-content-format", "--logits-processors", "--trust-request-chat-template"}
CPU_OR_LOCAL_ENV = {"TORCHDYNAMO_DISABLE", "HF_HOME", "VLLM_TARGET_DEVICE", "VLLM_CACHE_ROOT", "CUDA_VISIBLE_DEVICES",
                    "PYTHONUNBUFFERED", "PYTHONPATH"}

# Per rollwire command: its settings class and the fields of its listen address.
LISTENERS: dict[str, tuple[type[BaseSettings], str, str]] = {
    "proxy": (ProxySettings, "proxy_host", "proxy_port"),
    "processors": (ProcessorSettings, "host", "port"),
    "groups": (GroupSettings, "host", "port"),
    "rollout-server": (RolloutServerSettings, "host", "port"),
    "gateway-node": (GatewaySettings, "host", "port"),
    "ui": (UiSettings, "host", "port"),
}


# ---- the Compose CLI ----------------------------------------------------------------------------------------

def compose_cli() -> list[str]:
    """``docker compose``, else a ``docker-compose`` of v2 or later; fails (never skips) when there is none."""
    candidates = [["docker", "compose"]] if shutil.which("docker") else []
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    found = []
    for command in candidates:
        done = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=60)
        version = done.stdout.strip().removeprefix("v")
        if done.returncode == 0 and version and not version.startswith("1."):
            return command
        said = version or next(iter(done.stderr.strip().splitlines()), "no answer")
        found.append(f"`{' '.join(command)}`: {said}")
    pytest.fail(f"no Docker Compose v2 CLI ({'; '.join(found) or 'neither docker nor docker-compose is on PATH'}); "
                f"{INSTALL_HINT}")


def compose_config(*options: str) -> dict[str, Any]:
    """``compose config`` of deploy/compose.yaml as JSON, with only HOST_ENV of the variables it reads set."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("ROLLWIRE_", "FLEET_", "COMPOSE_"))}
    done = subprocess.run([*compose_cli(), "-f", str(COMPOSE), *options, "config", "--format", "json"],
                          capture_output=True, text=True, timeout=120, env={**env, **HOST_ENV})
    assert done.returncode == 0, f"compose config {' '.join(options)} failed:\n{done.stderr}"
    config: dict[str, Any] = json.loads(done.stdout)
    return config


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    """The services of the `cluster` and `fleet` profiles (and the default ones, which always come along)."""
    found: dict[str, dict[str, Any]] = compose_config(*PROFILES)["services"]
    return found


def engines(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if s["image"].startswith("vllm/vllm-openai:")}


def rollwire_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services that run the rollwire image (those built from this checkout)."""
    return {name: s for name, s in services.items() if "build" in s}


def by_command(services: dict[str, dict[str, Any]], command: str) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in rollwire_services(services).items() if s["command"][0] == command}


def flags(arguments: list[str]) -> dict[str, str | None]:
    """``--name=value`` and ``--name value`` arguments as {name: value}, a bare ``--name`` as {name: None}."""
    found: dict[str, str | None] = {}
    for i, argument in enumerate(arguments):
        if not argument.startswith("--"):
            continue
        name, equals, value = argument.partition("=")
        following = arguments[i + 1] if i + 1 < len(arguments) else None
        found[name] = value if equals else (following if following and not following.startswith("--") else None)
    return found


def depends(service: dict[str, Any]) -> dict[str, str]:
    return {name: entry["condition"] for name, entry in service.get("depends_on", {}).items()}


def variable(settings: type[BaseSettings], field: str, env: dict[str, Any]) -> tuple[str, str]:
    """The variable that sets ``settings``' ``field``, and its value in ``env`` (else the field's default)."""
    name = f"{settings.model_config.get('env_prefix', '')}{field}".upper()
    return name, str(env.get(name) or settings.model_fields[field].default)


# ---- the compose file ---------------------------------------------------------------------------------------

def test_default_and_cluster_services_are_as_before() -> None:
    """The profile adds services; `docker compose up` and `--profile cluster` still start what they did."""
    assert set(compose_config()["services"]) == {"kafka", "topics"}
    assert set(compose_config("--profile", "cluster")["services"]) == {
        "kafka", "topics", "kafka-1", "kafka-2", "kafka-3", "topics-cluster"}


def test_engines_each_hold_one_gpu_and_serve_rollwires_endpoints(services: dict[str, dict[str, Any]]) -> None:
    """vLLM's own image at the embedded engine's release, one GPU each, and every flag and variable of the
    embedded engine that rollwire relies on: the token endpoints, the weight API, the sampled logprobs."""
    fleet = engines(services)
    assert len(fleet) >= 2
    embedded = server_command(Path("python"), EngineConfig(), Path(MODEL))
    embedded_flags = flags(embedded)
    embedded_env = server_env(EngineConfig(), base={})
    gpus = []
    for name, engine in fleet.items():
        assert engine["image"] == f"vllm/vllm-openai:v{VLLM_VERSION}", name
        assert engine["profiles"] == ["fleet"]
        assert engine["entrypoint"] == ["python3", *embedded[1:3]], name  # -m vllm.entrypoints.openai.api_server
        devices = engine["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["capabilities"] == ["gpu"], name
        assert devices[0]["driver"] == "nvidia" and len(devices[0]["device_ids"]) == 1, name
        gpus.append(devices[0]["device_ids"][0])

        served = flags(engine["command"])
        for flag, value in embedded_flags.items():
            if flag not in CPU_OR_TINY_MODEL_FLAGS:
                assert flag in served, f"{name} lacks the embedded engine's {flag}"
        assert "--enable-scale-out" in served
        assert served["--logprobs-mode"] == embedded_flags["--logprobs-mode"] == "processed_logprobs"
        assert served["--model"] == MODEL and served["--served-model-name"] == SERVED
        for key, value in embedded_env.items():
            if key not in CPU_OR_LOCAL_ENV:
                assert engine["environment"].get(key) == value, f"{name}: {key} is not {value!r}"
        assert engine["environment"]["VLLM_SERVER_DEV_MODE"] == "1"

        # The model and the checkpoints at the paths the host names (a weight update names the trainer's).
        mounts = {(m["source"], m["target"], m.get("read_only", False)) for m in engine["volumes"]}
        assert {(MODEL, MODEL, True), (CHECKPOINTS, CHECKPOINTS, True)} <= mounts, name
        assert f"127.0.0.1:{served['--port']}/health" in " ".join(engine["healthcheck"]["test"])
    assert len(set(gpus)) == len(gpus), f"two engines reserve the same GPU: {gpus}"


def test_proxies_are_named_and_serve_every_engine(services: dict[str, dict[str, Any]]) -> None:
    proxies = by_command(services, "proxy")
    assert len(proxies) >= 2
    instances = [proxy["environment"]["ROLLWIRE_PROXY_INSTANCE"] for proxy in proxies.values()]
    assert instances == list(proxies), "each proxy process is named as its service"
    pool = {name: f"http://{name}:{flags(engine['command'])['--port']}" for name, engine in engines(services).items()}
    for name, proxy in proxies.items():
        env = proxy["environment"]
        entries = dict(entry.split("=", 1) for entry in env["ROLLWIRE_ENGINE_URLS"].split(","))
        assert entries == pool, f"{name} does not name every engine"
        assert env["ROLLWIRE_SERVED_MODEL"] == SERVED
        assert env["ROLLWIRE_PROXY_HOST"] == "0.0.0.0"
        # Every process sees the host's admin token, or none does.
        assert "ROLLWIRE_PROXY_ADMIN_TOKEN" in env and env["ROLLWIRE_PROXY_ADMIN_TOKEN"] is None
        assert depends(proxy) == {**{engine: "service_healthy" for engine in pool},
                                  "topics-cluster": "service_completed_successfully"}


def test_the_front_runs_the_config_and_waits_for_the_proxies(services: dict[str, dict[str, Any]]) -> None:
    front = services["front"]
    proxies = by_command(services, "proxy")
    port = variable(ProxySettings, "proxy_port", next(iter(proxies.values()))["environment"])[1]
    assert re.fullmatch(r"haproxy:\d+\.\d+\.\d+", front["image"]), "the HAProxy image is pinned to a release"
    assert front["profiles"] == ["fleet"]
    mounts = {(m["source"], m["target"]) for m in front["volumes"]}
    assert (str(FRONT_CONFIG), "/usr/local/etc/haproxy/haproxy.cfg") in mounts
    assert depends(front) == {name: "service_healthy" for name in proxies}
    assert [(p["target"], p["published"], p["host_ip"]) for p in front["ports"]] == [(int(port), port, "127.0.0.1")]
    servers = dict(re.findall(r"^\s*server\s+(\S+)\s+(\S+)", FRONT_CONFIG.read_text(), re.MULTILINE))
    assert servers == {name: f"{name}:{port}" for name in proxies}, "haproxy.cfg's servers are the proxy services"
    assert re.search(rf"^\s*bind\s+:{port}\s*$", FRONT_CONFIG.read_text(), re.MULTILINE)


def test_rollwire_services_read_only_variables_rollwire_config_lists(services: dict[str, dict[str, Any]]) -> None:
    """A misspelt or invented variable would be ignored by the settings classes in silence."""
    known = {row.name for row in variables()}
    ours = rollwire_services(services)
    assert set(ours) >= {"trajectories", "groups", "rollout", "gateway", "ui"} | set(by_command(services, "proxy"))
    for name, service in ours.items():
        unknown = set(service["environment"]) - known
        assert not unknown, f"{name} sets variables that `rollwire config` does not list: {sorted(unknown)}"


def test_rollwire_services_share_the_clusters_settings(services: dict[str, dict[str, Any]]) -> None:
    """One deployment: the cluster's brokers and replication everywhere, topics made before anything runs."""
    topics = services["topics-cluster"]["environment"]
    shared = ("ROLLWIRE_KAFKA_BOOTSTRAP", "ROLLWIRE_REPLICATION_FACTOR", "ROLLWIRE_MIN_INSYNC_REPLICAS")
    commands = {entry.name or (entry.callback.__name__ if entry.callback else "") for entry in app.registered_commands}
    for name, service in rollwire_services(services).items():
        assert service["profiles"] == ["fleet"], name
        assert service["command"][0] in commands, f"{name} runs no rollwire command"
        assert {key: service["environment"][key] for key in shared} == {key: topics[key] for key in shared}, name
        assert "ROLLWIRE_TOPIC_PREFIX" not in service["environment"], "topics-cluster makes the default prefix's"
        assert depends(service)["topics-cluster"] == "service_completed_successfully", name


def test_services_listen_where_their_health_checks_and_ports_look(services: dict[str, dict[str, Any]]) -> None:
    for name, service in rollwire_services(services).items():
        settings, host_field, port_field = LISTENERS[service["command"][0]]
        env = service["environment"]
        assert variable(settings, host_field, env) == (variable(settings, host_field, {})[0], "0.0.0.0"), name
        port = variable(settings, port_field, env)[1]
        assert f"http://127.0.0.1:{port}/health" in " ".join(service["healthcheck"]["test"]), name
        for published in service.get("ports", []):
            assert (published["target"], published["host_ip"]) == (int(port), "127.0.0.1"), name


def test_gateway_web_page_and_rollout_server(services: dict[str, dict[str, Any]]) -> None:
    gateway = services["gateway"]
    assert gateway["command"] == ["gateway-node"]
    assert gateway["environment"]["ROLLWIRE_GATEWAY_PROXY_URL"] == "http://front:18080"
    assert depends(gateway)["front"] == "service_started"
    ui = services["ui"]
    assert ui["environment"]["ROLLWIRE_UI_TOKENIZER"] == MODEL  # the engines' model decodes the traces
    assert (MODEL, MODEL) in {(m["source"], m["target"]) for m in ui["volumes"]}
    # The state that outlives a container: the workers' tables, the rollout server's delivered callbacks.
    for name in ("trajectories", "groups", "rollout"):
        home = services[name]["environment"]["ROLLWIRE_HOME"]
        assert any(m["type"] == "volume" and m["target"] == home for m in services[name]["volumes"]), name


def test_rollwire_image_is_built_from_this_checkout(services: dict[str, dict[str, Any]]) -> None:
    ours = rollwire_services(services)
    assert {service["image"] for service in ours.values()} == {"rollwire/services:latest"}
    for name, service in ours.items():
        assert Path(service["build"]["context"]) == ROOT, name
        assert service["build"]["dockerfile"] == str(DOCKERFILE.relative_to(ROOT)), name
    dockerfile = DOCKERFILE.read_text()
    assert 'ENTRYPOINT ["rollwire"]' in dockerfile and "pip install" in dockerfile
    # The build context keeps what installs the package (pyproject's packages, its readme) and nothing else.
    kept = {line[1:].strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert kept >= {"pyproject.toml", "README.md", "schemas", "proxy", "producers", "processors", "sinks", "deploy"}


# ---- the front's HAProxy configuration ----------------------------------------------------------------------

def backend_lines() -> list[str]:
    text = FRONT_CONFIG.read_text()
    section = re.search(r"^backend proxies\n(.*?)(?=^\S|\Z)", text, re.MULTILINE | re.DOTALL)
    assert section, "haproxy.cfg has no `backend proxies`"
    return [line.strip() for line in section.group(1).splitlines() if line.strip() and not line.strip().startswith("#")]


def test_front_hashes_on_the_session_and_retries_only_what_never_arrived() -> None:
    lines = backend_lines()
    keys = [line.split(")", 1)[1].split(" if ")[0].strip() for line in lines if line.startswith("http-request set-var")]
    assert [re.sub(r"[(,].*", "", key) for key in keys] == ["path", "req.fhdr", "req.fhdr", "req.fhdr", "url_param"]
    assert [re.search(r"\((.*?)\)", key).group(1) for key in keys[1:]] == [  # type: ignore[union-attr]
        "authorization", "x-api-key", "x-goog-api-key", "key"]
    assert "balance leastconn" in lines and "stick on var(txn.rw_affinity)" in lines
    assert [line for line in lines if line.startswith("retry-on")] == ["retry-on conn-failure"]
    assert "http-check send meth GET uri /health" in lines and "option httpchk" in lines
    text = FRONT_CONFIG.read_text()
    assert not re.search(r"^\s*(option http-buffer-request|compression|filter compression)", text, re.MULTILINE)
    proxy = ProxySettings()
    longest = max(proxy.policy_floor_wait_s + proxy.engine_timeout_s, proxy.weight_update_timeout_s)
    timeout = re.search(r"^\s*timeout server (\d+)s", text, re.MULTILINE)
    assert timeout and int(timeout.group(1)) > longest, "the front must never cut a call the proxy still holds"


def test_haproxy_accepts_the_front_config() -> None:
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (apt-get install -y haproxy)")
    done = subprocess.run(["haproxy", "-c", "-f", str(FRONT_CONFIG)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "[WARNING]" in line]
    # Only the proxies' names, which resolve on the compose network alone.
    assert all("could not resolve address" in line for line in warnings), "\n".join(warnings)


# ---- the front run against two stand-in proxies -------------------------------------------------------------

class _StandIn(BaseHTTPRequestHandler):
    """A proxy process: healthy, answers with its name, and streams two chunks a second apart on /stream."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path.endswith("/stream"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b"data: one\n\n", b"data: two\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                time.sleep(1.0)
            self.wfile.write(b"0\r\n\r\n")
            return
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _StandInServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, name: str) -> None:
        super().__init__(("127.0.0.1", 0), _StandIn)
        self.name = name

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # HAProxy ends its health checks' connections with a reset


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, _StandInServer]]]:
    """HAProxy running deploy/compose/haproxy.cfg, its servers pointed at two stand-ins on this machine."""
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (apt-get install -y haproxy)")
    stand_ins: dict[str, _StandInServer] = {}
    for name in ("proxy-1", "proxy-2"):
        server = _StandInServer(name)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        stand_ins[name] = server
    port = _free_port()
    text = FRONT_CONFIG.read_text().replace("bind :18080", f"bind 127.0.0.1:{port}")
    for name, server in stand_ins.items():
        text = text.replace(f"server {name} {name}:18080", f"server {name} 127.0.0.1:{server.server_port}")
    config = tmp_path_factory.mktemp("front") / "haproxy.cfg"
    config.write_text(text)
    process = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "HAProxy did not start"
            time.sleep(0.1)
        yield url, stand_ins
    finally:
        process.terminate()
        process.wait(timeout=10)
        for server in stand_ins.values():
            server.shutdown()
            server.server_close()


def _served_by(url: str, path: str, headers: dict[str, str] | None = None) -> str:
    response = httpx.get(f"{url}{path}", headers=headers or {}, timeout=10)
    assert response.status_code == 200
    assert response.headers["x-rollwire-proxy"] == response.text  # the front names the process that served
    return response.text


def test_front_keeps_each_session_on_one_proxy(front: tuple[str, dict[str, _StandInServer]]) -> None:
    url, _ = front
    placed = {f"s{i}": _served_by(url, f"/s/s{i}/v1/chat/completions") for i in range(24)}
    assert set(placed.values()) == {"proxy-1", "proxy-2"}, "sessions spread over both processes"
    for session, where in placed.items():
        assert _served_by(url, f"/s/{session}/v1/chat/completions") == where
        # The same key, however the harness sends it, goes where the same id goes.
        assert _served_by(url, "/v1/chat/completions", {"authorization": f"Bearer {session}"}) == where
        assert _served_by(url, "/v1/messages", {"x-api-key": session}) == where
        assert _served_by(url, "/v1beta/models/m:generateContent", {"x-goog-api-key": session}) == where
        assert _served_by(url, f"/v1beta/models/m:generateContent?key={session}") == where
    # The path's id wins over a key header.
    one, other = next((a, b) for a in placed for b in placed if placed[a] != placed[b])
    assert _served_by(url, f"/s/{one}/v1/chat/completions", {"authorization": f"Bearer {other}"}) == placed[one]


def test_front_relays_a_stream_as_it_comes(front: tuple[str, dict[str, _StandInServer]]) -> None:
    url, _ = front
    started = time.monotonic()
    with httpx.stream("GET", f"{url}/s/streaming/stream", timeout=10) as response:
        chunks = response.iter_raw()
        first = next(chunks)
        waited = time.monotonic() - started
        rest = b"".join(chunks)
    assert first.startswith(b"data: one") and b"data: two" in first + rest
    assert waited < 0.8, f"the first chunk took {waited:.2f} s: the front held the stream"


def test_front_sends_a_refused_request_to_the_other_proxy(front: tuple[str, dict[str, _StandInServer]]) -> None:
    """Runs last: it stops a stand-in. A request that could not reach its process goes to the other one."""
    url, stand_ins = front
    session = next(f"s{i}" for i in range(100) if _served_by(url, f"/s/s{i}/x") == "proxy-2")
    stand_ins["proxy-2"].shutdown()
    stand_ins["proxy-2"].server_close()
    assert _served_by(url, f"/s/{session}/x") == "proxy-1"
