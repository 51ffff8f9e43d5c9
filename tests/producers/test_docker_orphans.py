"""No session container outlives its session on a real Docker engine, whatever ends it.

A real gateway node (``python -m producers.gateway.cli``) runs a session in the docker runtime (a SWE-style
task image, its /testbed as the workspace, the ``command`` harness sleeping) and is SIGKILLed: Docker keeps
the container (nothing in the node could remove it), labelled with the dead node's pid; one reaper pass
removes it, run either as ``python -m producers.runtimes.reaper`` or by the next node at its start (which
also ends the orphaned session once, as an infrastructure failure). And on a node in this process with the
docker runtime: a session whose harness outlives its budget ends as a timeout, and a session cancelled
while its harness runs ends cancelled, each leaving no container.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from producers.gateway.control import create_app as create_control_app
from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings
from producers.runtimes.docker import DockerRuntime, docker_client
from producers.runtimes.reaper import NODE_LABEL, PID_LABEL, SESSION_LABEL
from schemas.sessions import FailureKind, SessionSpec, SessionStage, SessionStatus
from schemas.tasks import AgentSpec, RuntimeSpec
from schemas.transport import KafkaSettings
from tests.harnesses.common import serve_standin_proxy
from tests.producers.gateway_nodes import STAGES, Lifecycle, node_settings, publish, start_node, stop
from tests.proxy.conftest import ProxyUnderTest

pytestmark = [pytest.mark.kafka, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "rollwire/swe-rollwire__textstats-1:latest"
HARNESS = "sleep 300"


@pytest.fixture(scope="module")
def client(docker_images: list[str]) -> Any:
    assert IMAGE in docker_images
    return docker_client()


@pytest.fixture
def proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


def docker_spec(timeout_s: float = 600) -> SessionSpec:
    """A session in the task image (workspace /testbed, no ``repo``) whose harness sleeps."""
    return SessionSpec(session_id=f"dk-{uuid.uuid4().hex[:12]}", task_id="docker-orphans", instruction="wait",
                       timeout_s=timeout_s, api_key=f"key-{uuid.uuid4().hex}",
                       runtime=RuntimeSpec(kind="docker", image=IMAGE, workdir="/testbed", repo=None),
                       agent=AgentSpec(harness="command", command=HARNESS))


def containers_of(client: Any, session_id: str) -> list[Any]:
    return list(client.containers.list(all=True, ignore_removed=True,
                                       filters={"label": f"{SESSION_LABEL}={session_id}"}))


async def harness_container(client: Any, session_id: str, timeout_s: float = 90) -> Any:
    """The session's container, once the harness runs in it."""
    deadline = time.monotonic() + timeout_s
    while True:
        for container in containers_of(client, session_id):
            with contextlib.suppress(Exception):
                if any(HARNESS in " ".join(row) for row in container.top().get("Processes") or []):
                    return container
        assert time.monotonic() < deadline, f"the harness of {session_id} never ran in a container"
        await asyncio.sleep(0.3)


async def no_container_left(client: Any, session_id: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while left := containers_of(client, session_id):
        assert time.monotonic() < deadline, f"containers of {session_id} left: {[c.name for c in left]}"
        await asyncio.sleep(0.2)


# -- a node process killed hard -----------------------------------------------------------------------------

@pytest.mark.parametrize("reaper", ["command", "next-node"])
async def test_a_killed_nodes_container_is_reaped(kafka: KafkaSettings, proxy: ProxyUnderTest, client: Any,
                                                  tmp_path: Path, reaper: str) -> None:
    root = tmp_path / "sessions"
    root.mkdir()
    spec = docker_spec()
    node = start_node(kafka, proxy, root, "doomed")
    successor: subprocess.Popen | None = None
    try:
        async with Lifecycle(kafka) as lifecycle:
            await publish(kafka, spec)
            await lifecycle.wait(lambda: any(s.stage is SessionStage.RUNNING
                                             for s in lifecycle.stages(spec.session_id)), 120, "harness running")
            container = await harness_container(client, spec.session_id)
            assert container.labels[NODE_LABEL] == "doomed" and container.labels[PID_LABEL] == str(node.pid)
            node.kill()
            node.wait(30)
            await asyncio.sleep(1.0)
            kept = containers_of(client, spec.session_id)
            assert [c.id for c in kept] == [container.id], "Docker should keep a dead node's container"
            kept[0].reload()
            assert kept[0].status == "running"
            if reaper == "command":
                done = subprocess.run([sys.executable, "-m", "producers.runtimes.reaper"], cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                                      timeout=120)
                assert done.returncode == 0, done.stderr
                assert container.name in done.stdout.split(), (done.stdout, done.stderr)
                assert containers_of(client, spec.session_id) == []
            else:
                successor = start_node(kafka, proxy, root, "successor")
                await no_container_left(client, spec.session_id, timeout_s=90)
                end = (await lifecycle.ended(spec.session_id, timeout_s=120))[spec.session_id]
                assert end.status is SessionStatus.ERROR and end.failure is FailureKind.INFRASTRUCTURE, end
                assert "gateway node doomed stopped" in (end.reason or ""), end
                assert containers_of(client, spec.session_id) == []  # it was ended, not run again
    finally:
        stop(node)
        if successor is not None:
            stop(successor)
        for leftover in containers_of(client, spec.session_id):
            with contextlib.suppress(Exception):
                leftover.remove(force=True)


# -- a node in this process -------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def docker_node(settings: GatewaySettings, kafka: KafkaSettings, root: Path) -> AsyncIterator[GatewayNode]:
    """A node in this process whose sessions run in the docker runtime (sessions under ``root``)."""
    runtime = DockerRuntime(root, kill_grace_s=0.5)
    node = GatewayNode(settings, kafka, runtime_for=lambda kind: runtime)
    task = asyncio.create_task(node.run())
    await asyncio.wait_for(node.started.wait(), 30)
    try:
        yield node
    finally:
        node.stop_now()
        await asyncio.wait_for(task, 60)


async def test_a_session_past_its_budget_ends_as_a_timeout_and_leaves_no_container(
        kafka: KafkaSettings, proxy: ProxyUnderTest, client: Any, tmp_path: Path) -> None:
    spec = docker_spec(timeout_s=8.0)
    settings = node_settings(proxy, run_slots=1, prewarm=0)
    async with Lifecycle(kafka) as lifecycle, docker_node(settings, kafka, tmp_path / "sessions"):
        await publish(kafka, spec)
        container = await harness_container(client, spec.session_id)
        assert container.labels[NODE_LABEL] == settings.node_name
        end = (await lifecycle.ended(spec.session_id, timeout_s=90))[spec.session_id]
        assert containers_of(client, spec.session_id) == []  # removed before the session's end was told
    assert end.status is SessionStatus.TIMEOUT and end.failure is FailureKind.POLICY, end
    assert [s.stage.value for s in lifecycle.stages(spec.session_id)] == STAGES
    charged = end.timings["init"] + end.timings["ready"] + end.timings["running"]
    assert 8.0 <= charged < 8.0 + 10.0, end.timings


async def test_a_session_cancelled_while_running_leaves_no_container(
        kafka: KafkaSettings, proxy: ProxyUnderTest, client: Any, tmp_path: Path) -> None:
    spec = docker_spec()
    settings = node_settings(proxy, run_slots=1, prewarm=0)
    async with Lifecycle(kafka) as lifecycle, docker_node(settings, kafka, tmp_path / "sessions") as node:
        await publish(kafka, spec)
        await harness_container(client, spec.session_id)
        transport = httpx.ASGITransport(app=create_control_app(node))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
            answer = await http.post(f"/v1/sessions/{spec.session_id}/cancel", json={"reason": "not needed"})
        assert answer.status_code == 200 and answer.json()["stage"] == "running", answer.text
        end = (await lifecycle.ended(spec.session_id, timeout_s=60))[spec.session_id]
        assert containers_of(client, spec.session_id) == []
    assert end.status is SessionStatus.CANCELLED and end.failure is None, end
    assert end.timings["running"] < 30  # stopped, not run to its end
    assert [s.stage.value for s in lifecycle.stages(spec.session_id)] == STAGES
