"""`rollwire up --brokers 3`, `status` and `down` (deploy/cli.py) with a real three-node cluster in a private
home: the nodes are laid out from ROLLWIRE_KAFKA_PORT, the topics get three replicas with two in sync, and
later commands find the cluster from its layout without being told its size."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from schemas.topics import Topic, TopicRegistry
from schemas.transport import KafkaAdmin

pytestmark = pytest.mark.kafka


def _free_run(length: int) -> int:
    """A port p such that p .. p+length-1 are all free on 127.0.0.1."""
    for start in range(31000, 60000, 97):
        sockets = []
        try:
            for port in range(start, start + length):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


async def _replicas(bootstrap: str, topic: str) -> set[tuple[int, int]]:
    async with KafkaAdmin(bootstrap) as admin:
        return {(len(p.replicas), len(p.isr)) for p in await admin.partitions(topic)}


def test_up_with_three_brokers_then_status_and_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    base = _free_run(6)
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLWIRE_KAFKA_PORT", str(base))
    monkeypatch.setenv("ROLLWIRE_KAFKA_HEAP", "-Xms128m -Xmx384m")
    monkeypatch.setenv("ROLLWIRE_TOPIC_PREFIX", "clicluster.")
    for name in ("ROLLWIRE_KAFKA_BOOTSTRAP", "ROLLWIRE_REPLICATION_FACTOR", "ROLLWIRE_MIN_INSYNC_REPLICAS",
                 "ROLLWIRE_KAFKA_BROKERS", "ROLLWIRE_ENGINE_URL"):
        monkeypatch.delenv(name, raising=False)
    runner = CliRunner()
    try:
        up = runner.invoke(app, ["up", "--brokers", "3", "--no-engine", "--no-proxy", "--no-processors", "--no-ui"])
        assert up.exit_code == 0, up.output
        bootstrap = ",".join(f"127.0.0.1:{base + 2 * i}" for i in range(3))
        assert f"kafka_bootstrap={bootstrap}" in up.output and "kafka_running=3" in up.output, up.output
        assert "kafka_replicas=3" in up.output and "kafka_answers=True" in up.output
        layout = json.loads((tmp_path / "kafka" / "cluster.json").read_text())
        assert [(n["port"], n["controller_port"]) for n in layout["nodes"]] == [
            (base, base + 1), (base + 2, base + 3), (base + 4, base + 5)]
        completions = TopicRegistry(prefix="clicluster.").name(Topic.COMPLETIONS)
        assert asyncio.run(_replicas(bootstrap, completions)) == {(3, 3)}

        # Later commands find the cluster from its layout; asking for another size is refused.
        status = runner.invoke(app, ["status", "--json"])
        report = json.loads(status.output)
        assert report["kafka_managed"] and report["kafka_brokers"] == 3 and report["kafka_running"] == 3
        assert report["kafka_node2_bootstrap"] == f"127.0.0.1:{base + 2}"
        again = runner.invoke(app, ["up", "--no-engine", "--no-proxy", "--no-processors", "--no-ui"])
        assert again.exit_code == 0 and "topics_created=0" in again.output, again.output
        other = runner.invoke(app, ["up", "--brokers", "1", "--no-engine", "--no-proxy", "--no-processors", "--no-ui"])
        assert other.exit_code == 1 and "holds a 3-broker cluster, not 1" in other.output, other.output
    finally:
        down = runner.invoke(app, ["down"])
    assert down.exit_code == 0 and "kafka=stopped" in down.output, down.output
    stopped = json.loads(runner.invoke(app, ["status", "--json"]).output)
    assert stopped["kafka_running"] == 0 and not stopped["kafka_answers"]
