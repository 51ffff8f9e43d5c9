"""Several embedded engines: ``rollwire up --engines N`` starts N real vLLM CPU servers side by side, each
in its own home on consecutive ports, records them for ``status`` and ``down``, and names them to the proxy
as one pool; the wiring (ports, homes, the pool's variables, its entries' syntax) is checked without vLLM."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from deploy import stack
from deploy.cli import app
from deploy.engine.server import EngineConfig, VllmServer
from schemas.transport.admin import delete_topics

pytestmark = pytest.mark.timeout(1800)


def test_engines_take_consecutive_ports_and_their_own_homes(tmp_path: Path) -> None:
    base = EngineConfig(cache_dir=tmp_path / "cache", home=tmp_path / "home" / "engine", port=18000)
    configs = stack.engine_configs(3, base)
    assert [c.port for c in configs] == [18000, 18001, 18002]
    assert [c.home.name for c in configs] == ["engine", "engine-1", "engine-2"]
    assert configs[0].home == base.home and configs[0].port == base.port  # where the single engine always was
    cores = os.cpu_count() or 1
    assert [c.cpu_cores for c in configs] == [str(i % cores) for i in range(3)]  # a core each, not all on core 0
    assert len({c.model_dir for c in configs}) == 1  # one tiny model built, shared
    assert stack.engine_configs(1, base) == [base]
    with pytest.raises(stack.StackError, match="at least one"):
        stack.engine_configs(0, base)
    with pytest.raises(stack.StackError, match="65535"):
        stack.engine_configs(3, EngineConfig(home=tmp_path / "e", port=65534))


def test_pool_entries_parse_as_the_proxy_reads_them() -> None:
    entries = stack.parse_engine_entries(" engine-0=http://127.0.0.1:18000/ , http://10.0.0.2:8000\n"
                                         "# a comment line\nb=https://b.example:443")
    assert entries == [stack.EngineEntry("engine-0", "http://127.0.0.1:18000"),
                       stack.EngineEntry("http://10.0.0.2:8000", "http://10.0.0.2:8000"),
                       stack.EngineEntry("b", "https://b.example:443")]
    assert [e.spec for e in entries] == ["engine-0=http://127.0.0.1:18000", "http://10.0.0.2:8000",
                                         "b=https://b.example:443"]
    for bad, reason in (("engine-0=127.0.0.1:18000", "not an http"), ("a=http://x:1,a=http://y:2", "twice"),
                        ("ftp://x", "not an http"), ("a=http://", "not an http")):
        with pytest.raises(stack.StackError, match=reason):
            stack.parse_engine_entries(bad)


def test_the_proxy_is_told_every_engine_by_name() -> None:
    parts = [stack.Part("engine-0", "started", "http://127.0.0.1:18000"),
             stack.Part("engine-1", "reused", "http://127.0.0.1:18001")]
    assert stack.pool_env(parts) == {
        "ROLLWIRE_ENGINE_URLS": "engine-0=http://127.0.0.1:18000,engine-1=http://127.0.0.1:18001",
        "ROLLWIRE_ENGINE_URL": "http://127.0.0.1:18000"}


def test_external_pool_takes_precedence_and_status_and_down_follow_the_record(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLWIRE_ENGINE_URL", "http://one:1")
    monkeypatch.setenv("ROLLWIRE_ENGINE_URLS", "a=http://a:1,b=http://b:2")
    assert [e.name for e in stack.external_engines() or []] == ["a", "b"]
    monkeypatch.delenv("ROLLWIRE_ENGINE_URLS")
    assert stack.external_engines() == [stack.EngineEntry("http://one:1", "http://one:1")]
    monkeypatch.delenv("ROLLWIRE_ENGINE_URL")
    assert stack.external_engines() is None
    base = EngineConfig(home=tmp_path / "engine", port=18000)
    assert len(stack.recorded_engine_configs(base, tmp_path)) == 1  # no record: the default engine
    stack.write_pool_record([stack.EngineEntry("engine-0", "http://127.0.0.1:18000"),
                             stack.EngineEntry("engine-1", "http://127.0.0.1:18001")], tmp_path)
    assert [c.port for c in stack.recorded_engine_configs(base, tmp_path)] == [18000, 18001]


@pytest.mark.kafka
def test_up_with_two_engines_starts_both_and_down_stops_both(kafka_bootstrap: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The real bring-up: two vLLM CPU servers answer /v1/models, status reports each, down stops each."""
    first_port = stack.free_port_run(2)
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLWIRE_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("ROLLWIRE_TOPIC_PREFIX", f"engines{first_port}.")
    monkeypatch.setenv("ROLLWIRE_ENGINE_PORT", str(first_port))
    monkeypatch.delenv("ROLLWIRE_ENGINE_URL", raising=False)
    monkeypatch.delenv("ROLLWIRE_ENGINE_URLS", raising=False)
    configs = stack.engine_configs(2)
    try:
        up = CliRunner().invoke(app, ["up", "--engines", "2", "--no-proxy", "--no-processors", "--no-ui"])
        assert up.exit_code == 0, up.output
        for config in configs:
            models = httpx.get(f"{config.url}/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == [config.served_model_name]
            assert VllmServer(config).is_running()
        assert (tmp_path / "engine" / "vllm.pid").is_file() and (tmp_path / "engine-1" / "vllm.pid").is_file()
        assert stack.pool_record().read_text().splitlines() == [
            f"engine-0=http://127.0.0.1:{first_port}", f"engine-1=http://127.0.0.1:{first_port + 1}"]
        status = CliRunner().invoke(app, ["status", "--json"])
        report = json.loads(status.output)
        assert report["engines"] == 2
        for index in (0, 1):
            assert report[f"engine{index}_ready"] is True and report[f"engine{index}_healthy"] is True
            assert report[f"engine{index}_id"] == f"engine-{index}"
        again = CliRunner().invoke(app, ["up", "--engines", "2", "--no-proxy", "--no-processors", "--no-ui"])
        assert again.exit_code == 0, again.output  # both reused
        down = CliRunner().invoke(app, ["down"])
        assert down.exit_code == 0, down.output
        assert "engine=engine-0 stopped" in down.output and "engine=engine-1 stopped" in down.output
        assert not any(VllmServer(config).is_running() for config in configs)
    finally:
        for config in configs:
            VllmServer(config).stop()
        asyncio.run(delete_topics(kafka_bootstrap, f"engines{first_port}."))
