"""The `rollwire` CLI: stack status, schema export, `up` against a cluster it does not manage."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli import app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


@pytest.mark.kafka
def test_up_against_an_existing_cluster_only_creates_topics(kafka_bootstrap: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With ROLLWIRE_KAFKA_BOOTSTRAP naming another broker (the compose case), `up` starts no broker."""
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLWIRE_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("ROLLWIRE_TOPIC_PREFIX", "upcmd.")
    monkeypatch.setenv("ROLLWIRE_KAFKA_PORT", str(_free_port()))
    first = CliRunner().invoke(app, ["up", "--no-engine", "--no-proxy", "--no-processors", "--no-ui"])
    assert first.exit_code == 0, first.output
    assert "kafka_answers=True" in first.output and "kafka_managed=False" in first.output
    assert not (tmp_path / "kafka").exists()
    again = CliRunner().invoke(app, ["up", "--no-engine", "--no-proxy", "--no-processors", "--no-ui"])
    assert "topics_created=0" in again.output


def test_up_fails_clearly_when_the_named_cluster_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_KAFKA_BOOTSTRAP", f"127.0.0.1:{_free_port()}")
    result = CliRunner().invoke(app, ["up", "--no-engine", "--no-proxy", "--no-processors", "--no-ui"])
    assert result.exit_code == 1
    assert "no Kafka answers at ROLLWIRE_KAFKA_BOOTSTRAP" in result.output


def test_service_refuses_a_port_another_process_answers(tmp_path: Path) -> None:
    """Regression: a stray worker on the processors' port answered the health check of a new one, so
    `rollwire up` reported it healthy while the new worker died on the taken address."""
    from deploy.services import ServiceProcess, ServiceStartError
    from tests.servers import serve

    async def ok(scope, receive, send):  # a minimal ASGI app that answers 200 to anything
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    with serve(ok) as url:
        service = ServiceProcess(name="processors", args=("processors",), health_url=f"{url}/health", home=tmp_path)
        with pytest.raises(ServiceStartError, match="already answers"):
            service.start(timeout_s=5)
    assert not service.pid_file.exists()
