"""The main job's parts: the example tasks, the display built from hand-written events, following a task
on a real rollout server until it is done, and the whole job bringing up a stack in a private home."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from bench.standin_engine import StandinConfig, create_app as create_standin
from producers.rollout import job as rollout_job
from producers.rollout.display import progress_line, progress_table, stage_counts, summary_table
from producers.rollout.expand import expand
from producers.rollout.status import RolloutView
from producers.rollout.taskfile import Overrides, load_tasks
from schemas.evaluations import Evaluation
from schemas.rollouts import TaskState
from schemas.sessions import FailureKind, SessionEnded, SessionStage, SessionStageChanged, SessionStatus
from schemas.tasks import EvaluatorSpec, TaskRequest
from schemas.trajectories import Trajectory, TrajectoryStats
from schemas.transport import KafkaSettings
from tests.producers.rollout_helpers import publish, rollout_server, task_body
from tests.servers import free_port, serve

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks.jsonl"


def _render(renderable: object) -> str:
    console = Console(record=True, width=220, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_example_tasks_are_real_failing_repos(tmp_path: Path) -> None:
    good, bad = load_tasks(EXAMPLES, Overrides(harness="codex", samples=4, task_id_suffix="r1"))
    assert bad == [] and len(good) >= 2
    for line in good:
        request = line.request
        assert request.agent.harness == "codex" and request.num_samples == 4
        assert request.task_id.endswith("-r1")
        assert request.evaluator is not None and request.evaluator.name == "tests"
        repo = Path(request.runtime.repo or "")
        assert repo.is_absolute() and repo.is_dir(), repo
        # The repo's tests fail as given: there is a bug for the harness to fix.
        work = tmp_path / repo.name
        shutil.copytree(repo, work)
        run = subprocess.run([sys.executable, "-m", "unittest", "-q"], cwd=work, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode != 0 and "FAILED" in run.stderr, run.stderr


def _finished_view() -> tuple[RolloutView, str]:
    request = TaskRequest(task_id="demo", instruction="fix it", num_samples=3, agent={"harness": "pi"},
                          evaluator=EvaluatorSpec(name="tests"))
    accepted, specs = expand(request)
    a, b, c = (s.session_id for s in specs)
    view = RolloutView(evaluation_wait_s=3600)
    events = [
        accepted,
        SessionStageChanged(session_id=a, stage=SessionStage.INIT),
        SessionStageChanged(session_id=a, stage=SessionStage.RUNNING, elapsed_s=2.0),
        SessionStageChanged(session_id=b, stage=SessionStage.INIT),
    ]
    for event in events:
        view.apply(event)
    return view, accepted.task_id


def test_display_shows_stages_then_the_summary() -> None:
    view, task_id = _finished_view()
    a, b, c = view.task(task_id).session_ids  # type: ignore[union-attr]
    for _ in range(3):
        view.count_completions(a)
    status = view.status(task_id)
    assert status is not None and status.state == TaskState.RUNNING
    assert stage_counts([status])["running"] == 1 and stage_counts([status])["queued"] == 1
    assert "completions=3" in progress_line([status], 12.0)
    live = _render(progress_table([status], 12.0))
    assert "demo" in live and "running" in live

    for event in (
        SessionEnded(session_id=a, status=SessionStatus.COMPLETED, timings={"init": 2.0, "running": 6.0}),
        SessionEnded(session_id=b, status=SessionStatus.ERROR, failure=FailureKind.POLICY, reason="bad patch",
                     timings={"init": 4.0, "running": 1.0}),
        SessionEnded(session_id=c, status=SessionStatus.ERROR, failure=FailureKind.INFRASTRUCTURE,
                     reason="runtime init failed"),
        Trajectory(session_id=a, builder="prefix_merging", traces=[], stats=TrajectoryStats(completions=3)),
        Evaluation(session_id=a, evaluator="tests", reward=1.0, passed=True),
        Evaluation(session_id=b, evaluator="tests", reward=0.0, passed=False),
    ):
        view.apply(event)
    status = view.status(task_id)
    assert status is not None and status.state == TaskState.DONE
    assert status.result is not None and status.result.mean_reward == 0.5 and status.result.complete
    summary = _render(summary_table([status]))
    row = next(line for line in summary.splitlines() if line.strip("│┃ ").startswith("demo"))
    cells = [cell.strip() for cell in row.strip("│┃ ").split("│")]
    # task, sessions, completed, failed policy, failed infra, not ended, completions, trajectories, reward,
    # passed, then mean seconds per stage (init 3.0 over two sessions, running 3.5).
    assert cells[:10] == ["demo", "3", "1", "1", "1", "0", "3", "1", "0.50 (2)", "1/2"]
    assert cells[10:12] == ["3.0", "-"] and cells[12] == "3.5"
    assert rollout_job.exit_code([status]) == 1  # one infrastructure failure


async def test_follow_waits_for_the_task_on_a_real_server(kafka: KafkaSettings, tmp_path: Path) -> None:
    import httpx

    with rollout_server(kafka, tmp_path) as url:
        answer = httpx.post(f"{url}/v1/tasks", json=task_body("follow-1", samples=2), timeout=30).json()
        first, second = answer["session_ids"]
        console = Console(record=True, width=200, color_system=None)
        following = asyncio.create_task(asyncio.to_thread(
            rollout_job.follow, console, url, ["follow-1"], 60.0, False))
        await asyncio.sleep(1.5)
        await publish(kafka, SessionStageChanged(session_id=first, stage=SessionStage.RUNNING),
                      SessionStageChanged(session_id=second, stage=SessionStage.INIT))
        await asyncio.sleep(1.5)
        await publish(kafka, SessionEnded(session_id=first, status=SessionStatus.COMPLETED),
                      SessionEnded(session_id=second, status=SessionStatus.TIMEOUT, failure=FailureKind.POLICY))
        statuses = await asyncio.wait_for(following, 60)
    assert [s.state for s in statuses] == [TaskState.DONE]
    assert rollout_job.exit_code(statuses) == 0  # a policy timeout is not the infrastructure's failure
    text = console.export_text()
    assert "queued=2" in text and "running=1" in text and "tasks done 1/1" in text


def test_job_brings_up_a_stack_and_summarizes(kafka_bootstrap: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole job in a private home and topic prefix over the stand-in engine: it starts a proxy,
    processors and a rollout server (a gateway node where this build has one), submits a `command`
    harness task, and reports; without a gateway node nothing runs the session, so it ends with exit 1."""
    from deploy import cli as deploy_cli

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "job", "instruction": "say hi", "num_samples": 1, "timeout_s": 60,
                                 "agent": {"harness": "command", "command": "echo {instruction}"}}) + "\n")
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=8))) as engine_url:
        for name, value in {"ROLLWIRE_HOME": str(tmp_path / "home"), "ROLLWIRE_KAFKA_BOOTSTRAP": kafka_bootstrap,
                            "ROLLWIRE_TOPIC_PREFIX": f"j{uuid.uuid4().hex[:8]}.", "ROLLWIRE_ENGINE_URL": engine_url,
                            "ROLLWIRE_PROXY_PORT": str(free_port()), "ROLLWIRE_PROCESSORS_PORT": str(free_port()),
                            "ROLLWIRE_PROCESSORS_STORE": "memory", "ROLLWIRE_ROLLOUT_PORT": str(free_port()),
                            "ROLLWIRE_GATEWAY_PORT": str(free_port()), "ROLLWIRE_SESSION_PARTITIONS": "2",
                            "ROLLWIRE_TASK_PARTITIONS": "1"}.items():
            monkeypatch.setenv(name, value)
        console = Console(record=True, width=220, color_system=None)
        has_gateway = rollout_job._has_command("gateway-node")
        try:
            code = rollout_job.run_job(rollout_job.JobOptions(tasks_file=tasks, timeout_s=10 if not has_gateway
                                                              else 90, live=False), console)
        finally:
            kafka = KafkaSettings()
            deploy_cli._proxy_service(kafka, engine_url).stop()
            deploy_cli._processors_service(kafka).stop()
    text = console.export_text()
    assert "proxy            started" in text and "processors       started" in text, text
    assert "rollout-server   started" in text and "stopped rollout-server" in text, text
    assert "submitted 1 tasks, 1 sessions" in text and "rollout summary" in text, text
    assert "trajectories" in text and "/v1/tasks/job-r" in text, text
    if has_gateway:
        assert "gateway-node     started" in text, text
        assert code == 0 and "completed" in text, text  # `echo` ran as the harness; no model call, no trajectory due
    else:
        assert "gateway-node     skipped" in text, text
        assert code == 1 and "not ended (queued)" in text, text
