"""A real CLI in a real container on a SWE-style instance, graded in a fresh container.

Qwen Code runs inside the instance's own image (``rollwire images build``: the Debian base with Node, the
pinned CLIs, the repository at ``/testbed`` at its base commit) under the docker runtime of a gateway node,
with no network: it reaches the proxy only through the session's socket relay. The model's turns are
scripted (``engine.turns``, forced on the stand-in engine): a ``write_file`` call that writes the gold fix,
then an answer. The session's patch is then graded by the ``swebench`` evaluator in a fresh container of
the same image: resolved, reward 1. No container of the session or its grading is left afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from processors.evaluators.swebench import SwebenchEvaluator
from producers.gateway.node import GatewayNode
from producers.runtimes.docker import DockerRuntime
from schemas.sessions import SessionSpec, SessionStatus
from schemas.swebench import SwebenchInstance, read_instances, to_task_request
from schemas.tasks import EngineParams
from schemas.transport import KafkaSettings
from tests.harnesses.common import Script, ToolStep, serve_standin_proxy
from tests.producers.gateway_nodes import Lifecycle, node_settings, publish
from tests.proxy.conftest import ProxyUnderTest

pytestmark = [pytest.mark.kafka, pytest.mark.docker]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "swebench"


def _instance(instance_id: str) -> SwebenchInstance:
    records, bad = read_instances(EXAMPLES / "instances.jsonl")
    assert not bad, bad
    return next(r.instance for r in records if r.instance.instance_id == instance_id)


def _fixed_files(instance: SwebenchInstance, tmp_path: Path) -> dict[str, str]:
    """The files the gold patch changes, as they read after it: what the scripted turn writes."""
    repo = tmp_path / "gold"
    shutil.copytree(EXAMPLES / "repos" / instance.instance_id, repo)
    assert instance.patch
    applied = subprocess.run(["patch", "-p1", "--batch"], cwd=repo, input=instance.patch, text=True,
                             capture_output=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    names = [line[len("+++ b/"):] for line in instance.patch.splitlines() if line.startswith("+++ b/")]
    return {name: (repo / name).read_text() for name in names}


def _containers(session_id: str) -> list[Any]:
    import docker

    client = docker.from_env()
    try:
        return list(client.containers.list(all=True, ignore_removed=True,
                                           filters={"label": f"rollwire.session={session_id}"}))
    finally:
        client.close()


@pytest.fixture
def proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


async def test_qwen_code_in_a_container_fixes_an_instance_graded_in_a_fresh_one(
        kafka: KafkaSettings, proxy: ProxyUnderTest, docker_images: list[str], tmp_path: Path) -> None:
    instance = _instance("rollwire__textstats-1")
    fixed = _fixed_files(instance, tmp_path)
    # Qwen Code's write_file refuses to overwrite a file it has not read: the fix goes through its shell tool.
    script = Script(steps=tuple(ToolStep("run_shell_command", {
                                    "command": f"echo {base64.b64encode(text.encode()).decode()} | base64 -d > {name}",
                                    "description": f"Write the fixed {name}"})
                                for name, text in fixed.items()),
                    answer="word_count now splits on any whitespace.", expected_files={})
    task = to_task_request(instance, harness="qwen-code", engine=EngineParams(max_tokens=2048, turns=script.turns()))
    assert task.runtime.kind == "docker" and task.runtime.network == "relay"
    session_id = f"swe-{uuid.uuid4().hex[:10]}"
    spec = SessionSpec(session_id=session_id, task_id=task.task_id, instruction=task.instruction,
                       runtime=task.runtime, agent=task.agent, evaluator=task.evaluator, engine=task.engine,
                       timeout_s=600, api_key=f"key-{uuid.uuid4().hex}")

    runtime = DockerRuntime(root=tmp_path / "sessions")
    node = GatewayNode(node_settings(proxy, prewarm=0), kafka, runtime_for=lambda kind: runtime)
    async with Lifecycle(kafka) as lifecycle:
        node_task = asyncio.create_task(node.run())
        await asyncio.wait_for(node.started.wait(), 60)
        try:
            await publish(kafka, spec)
            ended = (await lifecycle.ended(session_id, timeout_s=420))[session_id]
        finally:
            node.stop_now()
            await asyncio.wait_for(node_task, 120)

    assert ended.status is SessionStatus.COMPLETED, (ended.reason, ended.artifacts)
    assert ended.patch and all(f"b/{name}" in ended.patch for name in fixed), ended.artifacts
    # Every call of the session came through the relay and was recorded: the tool turn and the answer.
    events = [e for e in await proxy.completions(script.calls) if e.session_id == session_id]
    assert [e.status for e in events] == ["ok"] * script.calls
    assert not _containers(session_id), "the session's container outlived its teardown"

    evaluation = await SwebenchEvaluator().evaluate(ended, spec)
    assert evaluation.status == "ok", evaluation.error
    assert evaluation.reward == 1.0 and evaluation.passed is True, evaluation.details
    assert evaluation.details["resolved"] is True
    assert not _containers(f"eval-{session_id}"), "the grading container was left behind"
