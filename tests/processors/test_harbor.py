"""Harbor tasks on a real Docker engine: the example set's images built here, sessions run in them, the
``harbor`` evaluator's verifier in a fresh container.

The oracle (each task's solution/solve.sh, run as the session's harness would be) must score 1 on every
example task; a session that does nothing must score what the verifier's file says of the untouched
environment (0), read from a container that is not the session's; a task whose Dockerfile builds on an
image the engine lacks must fail the session's init naming that image (the gateway node then ends it as an
infrastructure failure, runtime_init); a verifier that writes no reward or a malformed one is the
evaluator's error, never a silent 0. The environment images are built once per test run (cached by the
digest of their folder, like the other images).
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.docker

from processors.evaluators.harbor import HarborEvaluator, RewardFileError, parse_reward
from producers.gateway.node import GatewayNode
from producers.runtimes.docker import DockerRuntime, docker_client
from producers.runtimes.reaper import SESSION_LABEL
from schemas.attribution import Cause
from schemas.harbor import ORACLE_COMMAND, HarborTask, read_task, read_tasks, to_task_request
from schemas.sessions import FailureKind, SessionEnded, SessionSpec, SessionStatus
from schemas.tasks import TaskRequest
from schemas.transport import KafkaSettings
from tests.harnesses.common import serve_standin_proxy
from tests.producers.gateway_nodes import Lifecycle, node_settings, publish
from tests.proxy.conftest import ProxyUnderTest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "harbor"


@pytest.fixture(scope="module")
def tasks(docker_images: list[str]) -> dict[str, HarborTask]:
    """The example tasks (rollwire/base is on the engine: tests/conftest.py builds it)."""
    good, bad = read_tasks(EXAMPLES)
    assert not bad and len(good) == 3
    return {task.name: task for task in good}


@pytest.fixture
def runtime(tmp_path: Path) -> DockerRuntime:
    return DockerRuntime(tmp_path / "sessions", mount_harness_cache=False)


async def run_session(runtime: DockerRuntime, request: TaskRequest, argv: list[str] | None) -> tuple[str, str]:
    """A session of ``request`` as the gateway node runs it (init, the harness's command, patch, teardown):
    its patch and the command's stdout."""
    handle = await runtime.init(f"harbor-{uuid.uuid4().hex[:8]}", request.runtime, timeout_s=600)
    try:
        stdout = ""
        if argv is not None:
            result = await handle.run(argv, env={}, timeout_s=120)
            assert result.exit_code == 0, result.stderr
            stdout = result.stdout
        return await handle.patch(), stdout
    finally:
        await handle.teardown()


async def score(request: TaskRequest, patch: str, tmp_path: Path) -> Any:
    spec = SessionSpec(session_id=f"h-{uuid.uuid4().hex[:8]}", task_id=request.task_id,
                       instruction=request.instruction, runtime=request.runtime, agent=request.agent,
                       evaluator=request.evaluator)
    ended = SessionEnded(session_id=spec.session_id, task_id=request.task_id, status=SessionStatus.COMPLETED,
                         patch=patch)
    evaluation = await HarborEvaluator(scratch=tmp_path / "eval").evaluate(ended, spec)
    left = docker_client().containers.list(all=True, filters={"label": f"{SESSION_LABEL}=harbor-eval-{spec.session_id}"})
    assert left == []
    return evaluation


async def test_the_oracle_scores_one_on_every_example_task(tasks: dict[str, HarborTask], runtime: DockerRuntime,
                                                           tmp_path: Path) -> None:
    for task in tasks.values():
        request = to_task_request(task, harness="qwen-code", oracle=True)
        assert request.agent.harness == "command" and request.agent.command == ORACLE_COMMAND
        assert request.evaluator is not None and request.evaluator.name == "harbor"
        patch, _ = await run_session(runtime, request, ["bash", "-c", ORACLE_COMMAND.split(" ", 2)[2][1:-1]])
        assert patch.strip(), f"{task.name}: the oracle changed nothing under the WORKDIR"
        evaluation = await score(request, patch, tmp_path)
        assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 1.0, True), evaluation


async def test_a_session_that_does_nothing_scores_what_the_verifier_file_says(
        tasks: dict[str, HarborTask], runtime: DockerRuntime, tmp_path: Path) -> None:
    request = to_task_request(tasks["fix-fizzbuzz"], harness="command", command="true")
    patch, _ = await run_session(runtime, request, None)
    assert patch == ""
    evaluation = await score(request, patch, tmp_path)
    assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 0.0, False)
    assert evaluation.details["reward_file"] == "/logs/verifier/reward.json"
    assert evaluation.details["rewards"] == {"reward": 0.0, "passed": 1.0, "total": 2.0}
    assert "FAILED test_fizzbuzz.py::test_multiples_of_fifteen" in evaluation.details["output"]


async def test_the_verifier_does_not_see_what_the_session_left_outside_its_changes(
        tasks: dict[str, HarborTask], runtime: DockerRuntime, tmp_path: Path) -> None:
    """A session that plants a reward file of its own gets nothing for it: the verifier's container is
    fresh, and its /logs/verifier starts empty."""
    request = to_task_request(tasks["count-words"], harness="command", command="true")
    patch, _ = await run_session(runtime, request, ["sh", "-c", "mkdir -p /logs/verifier && echo 1 > "
                                                    "/logs/verifier/reward.txt && echo 1 > /app/planted.txt"])
    assert "planted.txt" in patch
    evaluation = await score(request, patch, tmp_path)
    assert (evaluation.status, evaluation.reward) == ("ok", 0.0)


@pytest.fixture
def proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


@pytest.mark.kafka
async def test_a_task_whose_image_cannot_be_built_is_an_infrastructure_failure_with_the_reason(
        kafka: KafkaSettings, proxy: ProxyUnderTest, tmp_path: Path, docker_images: list[str]) -> None:
    """Its Dockerfile builds on an image the engine lacks: a real gateway node ends the session in init,
    runtime_init (infrastructure), its reason naming the image and how to provide it, before any pull."""
    task_dir = tmp_path / "tasks" / "needs-ubuntu"
    shutil.copytree(EXAMPLES / "count-words", task_dir)
    (task_dir / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04-rollwire-absent\nWORKDIR /app\n")
    request = to_task_request(read_task(task_dir), harness="command", command="true")
    spec = SessionSpec(session_id=f"unbuildable-{uuid.uuid4().hex[:8]}", task_id=request.task_id,
                       instruction=request.instruction, runtime=request.runtime, agent=request.agent,
                       evaluator=request.evaluator, timeout_s=120)
    settings = node_settings(proxy)
    node = GatewayNode(settings, kafka, runtime_for=lambda kind: DockerRuntime(tmp_path / "sessions",
                                                                                mount_harness_cache=False))
    running = asyncio.create_task(node.run())
    try:
        await asyncio.wait_for(node.started.wait(), 30)
        async with Lifecycle(kafka) as lifecycle:
            await publish(kafka, spec)
            ended = (await lifecycle.ended(spec.session_id, timeout_s=120))[spec.session_id]
    finally:
        node.stop_now()
        await asyncio.wait_for(running, 60)
    assert (ended.status, ended.cause, ended.failure) == (SessionStatus.ERROR, Cause.RUNTIME_INIT,
                                                          FailureKind.INFRASTRUCTURE), ended
    reason = ended.reason or ""
    assert "'ubuntu:24.04-rollwire-absent' is not on this Docker engine" in reason, reason
    assert "docker load" in reason and "FROM rollwire/base:bookworm" in reason


async def test_a_verifier_without_a_reward_file_is_an_error_not_zero(tasks: dict[str, HarborTask],
                                                                     tmp_path: Path) -> None:
    task_dir = tmp_path / "silent" / "count-words"  # the same image: only tests/ differs
    shutil.copytree(tasks["count-words"].path, task_dir)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho checked\n")
    request = to_task_request(read_task(task_dir), harness="command", command="true")
    evaluation = await score(request, "", tmp_path)
    assert evaluation.status == "error" and evaluation.reward is None
    assert "wrote no reward file" in (evaluation.error or "")


def test_reward_files_are_read_as_harbor_writes_them() -> None:
    assert parse_reward("/logs/verifier/reward.txt", " 0.25\n") == (0.25, {"reward": 0.25})
    assert parse_reward("r/reward.json", '{"reward": 1, "style": 0.5}') == (1.0, {"reward": 1.0, "style": 0.5})
    assert parse_reward("r/reward.json", '{"accuracy": 0.75}') == (0.75, {"accuracy": 0.75})
    for name, text in (("reward.txt", "passed"), ("reward.json", "[1]"), ("reward.json", '{"a": 1, "b": 0}'),
                       ("reward.json", '{"reward": true}'), ("reward.txt", "nan")):
        with pytest.raises(RewardFileError):
            parse_reward(name, text)


def test_a_task_folder_becomes_one_docker_task(tasks: dict[str, HarborTask]) -> None:
    task = tasks["count-words"]
    request = to_task_request(task, harness="qwen-code", samples=4, task_id_suffix="r1")
    assert request.task_id == "count-words-r1" and request.num_samples == 4
    assert request.runtime.kind == "docker" and request.runtime.image == task.image
    assert request.runtime.build is not None and request.runtime.build.context == str(task.path / "environment")
    assert (request.runtime.cpus, request.runtime.memory) == (1, "512m")
    assert request.timeout_s == 300.0 + 300.0
    assert request.evaluator is not None and request.evaluator.settings["timeout_s"] == 60.0
    judged = to_task_request(tasks["set-port"], harness="qwen-code")
    assert judged.evaluator is not None and judged.evaluator.name == "judge"
    assert judged.evaluator.settings["outcome"]["name"] == "harbor"
    assert "8443" in judged.evaluator.settings["rubric"] and judged.evaluator.settings["coefficient"] == 0.5


def test_a_changed_environment_is_a_new_image(tasks: dict[str, HarborTask], tmp_path: Path) -> None:
    copy = tmp_path / "count-words"
    shutil.copytree(tasks["count-words"].path, copy)
    assert read_task(copy).image == tasks["count-words"].image
    (copy / "environment" / "notes.txt").write_text("one two\n")
    assert read_task(copy).image != tasks["count-words"].image


def test_concurrent_first_sessions_build_the_image_once(tasks: dict[str, HarborTask], tmp_path: Path) -> None:
    """Two sessions of a task whose image is not built yet: one builds, the other waits and finds it."""
    copy = tmp_path / "fresh" / "count-words"
    shutil.copytree(tasks["count-words"].path, copy)
    (copy / "environment" / "notes.txt").write_text(f"{uuid.uuid4().hex} words\n")
    request = to_task_request(read_task(copy), harness="command", command="true")
    runtime = DockerRuntime(tmp_path / "sessions", mount_harness_cache=False)
    build, image = request.runtime.build, request.runtime.image
    assert build is not None and image is not None
    client = docker_client()

    async def both() -> list[bool]:
        return list(await asyncio.gather(*(asyncio.to_thread(runtime._builds.ensure, client, image, build)
                                           for _ in range(2))))
    try:
        assert sorted(asyncio.run(both())) == [False, True]
    finally:
        client.images.remove(image, force=True)
