"""Test fixtures: the project's real Apache Kafka, started once per test run (or reused if one is up).

The broker and the engine are brought up by the same routines as ``rollwire up`` and the main job
(deploy/stack.py). If ``ROLLWIRE_KAFKA_BOOTSTRAP`` names a broker
that answers, it is reused; otherwise a broker is started in a temporary home on a free port and stopped
at the end of the run. Every test that writes gets topics under its own fresh prefix, so tests never see
each other's records, even on a reused broker.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from deploy import stack
from deploy.engine.server import EngineConfig, VllmServer
from deploy.kafka import KafkaConfig
from schemas.transport.admin import broker_answers, delete_topics, ensure_topics
from schemas.transport.settings import KafkaSettings

# Helpers moved out of test modules keep pytest's assertion messages (it rewrites only tests and conftests).
pytest.register_assert_rewrite("tests.processors.worker_process", "tests.producers.gateway_nodes")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of a real broker for this test run (deploy.stack.broker: reused or started)."""
    configured = os.environ.get("ROLLWIRE_KAFKA_BOOTSTRAP")
    base = KafkaConfig.from_env()
    config = KafkaConfig(version=base.version, cache_dir=base.cache_dir,
                         home=tmp_path_factory.mktemp("kafka-home"), host="127.0.0.1",
                         port=_free_port(), controller_port=_free_port(), heap=base.heap,
                         max_message_bytes=base.max_message_bytes)
    reuse = configured if configured and broker_answers(configured) else None
    part = stack.broker(config, reuse, timeout_s=240)
    try:
        yield part.address
    finally:
        if part.stop is not None:
            part.stop()


@pytest.fixture
async def kafka(kafka_bootstrap: str) -> AsyncIterator[KafkaSettings]:
    """Settings for a fresh set of topics (unique prefix) on the test broker, topics created."""
    settings = KafkaSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
                             session_partitions=4, task_partitions=2)
    await ensure_topics(settings)
    yield settings
    await delete_topics(kafka_bootstrap, settings.topic_prefix)


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real vLLM CPU server over the tiny model, started once per run (its venv and model are cached).

    ``ROLLWIRE_TEST_ENGINE_URL`` reuses a server that is already up.
    """
    from deploy.engine.server import EngineConfig

    configured = os.environ.get("ROLLWIRE_TEST_ENGINE_URL")
    reuse = configured if configured and stack.answers(f"{configured}/v1/models", timeout_s=5) else None
    base = EngineConfig.from_env()
    # A context that holds a real harness's prompt (Qwen Code's is about 16k tokens).
    config = EngineConfig(cache_dir=base.cache_dir, home=tmp_path_factory.mktemp("engine-home"),
                          port=_free_port(), max_model_len=32768)
    part = stack.engine(reuse, config, timeout_s=1800)
    try:
        yield part.address
    finally:
        if part.stop is not None:
            part.stop()


@dataclass(frozen=True)
class PoolEngine:
    """One engine of the ``vllm_engines`` pool: its URL, and its server when this run started it (a test
    that kills and restarts an engine needs that; a reused engine has none)."""

    url: str
    server: VllmServer | None = None


@pytest.fixture(scope="session")
def vllm_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[PoolEngine]]:
    """Two real vLLM CPU servers over the tiny model, each with its own home, started side by side once
    per run by the routine behind ``rollwire up --engines 2`` (deploy.stack.engines).

    ``ROLLWIRE_TEST_ENGINE_URLS`` (comma-separated, ``URL`` or ``NAME=URL``) reuses servers that are
    already up, when each of them answers.
    """
    configured = stack.parse_engine_entries(os.environ.get("ROLLWIRE_TEST_ENGINE_URLS", ""),
                                            source="ROLLWIRE_TEST_ENGINE_URLS")
    if len(configured) >= 2 and all(stack.answers(f"{e.url}/v1/models", timeout_s=5) for e in configured):
        yield [PoolEngine(entry.url) for entry in configured]
        return
    base = EngineConfig.from_env()
    config = EngineConfig(cache_dir=base.cache_dir, home=tmp_path_factory.mktemp("engines") / "engine",
                          port=stack.free_port_run(2), max_model_len=32768)
    configs = stack.engine_configs(2, config)
    parts = stack.engines(None, configs, timeout_s=1800)
    try:
        yield [PoolEngine(part.address, VllmServer(config)) for part, config in zip(parts, configs, strict=True)]
    finally:
        for engine_config in configs:  # also an engine a test restarted, which no part's stop knows of
            VllmServer(engine_config).stop()


@pytest.fixture(scope="session")
def vllm_urls(vllm_engines: list[PoolEngine]) -> list[str]:
    """The URLs of the ``vllm_engines`` pool."""
    return [engine.url for engine in vllm_engines]


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """A Docker engine for the docker runtime's tests (deploy/docker_engine.py): one that answers, else
    rollwire's own ``dockerd`` started here and stopped at the end of the run. ``.ci/run`` installs
    Debian's docker.io; without ``dockerd`` the tests fail saying what to install."""
    from deploy import docker_engine

    started = docker_engine.find_engine() is None
    url = docker_engine.ensure_engine()
    try:
        yield url
    finally:
        if started:
            docker_engine.stop_engine()


@pytest.fixture(scope="session")
def docker_images(docker_engine: str) -> list[str]:
    """The images the docker tests run (``rollwire images build``: the Debian base, the pinned CLIs, the
    SWE-style examples' instance images), built once and kept by the engine's data root across runs."""
    from pathlib import Path

    from deploy.images import build_images

    instances = Path(__file__).resolve().parents[1] / "examples" / "swebench" / "instances.jsonl"
    results = build_images(instances, say=lambda line: print(line, flush=True))
    return [r.image for r in results]
