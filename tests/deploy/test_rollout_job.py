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

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from deploy import job as rollout_job
from producers.rollout.display import (
    acceptance_line,
    groups_table,
    progress_line,
    progress_table,
    sessions_table,
    stage_counts,
    summary_table,
)
from producers.rollout.expand import expand
from producers.rollout.status import RolloutView
from producers.rollout.taskfile import Overrides, load_tasks
from schemas.evaluations import Evaluation
from schemas.groups import Group, GroupSample
from schemas.rollouts import TaskState
from schemas.sessions import FailureKind, SessionEnded, SessionStage, SessionStageChanged, SessionStatus
from schemas.tasks import EvaluatorSpec, TaskRequest
from schemas.trajectories import Trajectory, TrajectoryStats
from schemas.transport import KafkaSettings
from tests.harnesses.common import turn_token_ids
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

    # The scripted example forces Qwen Code's turns: a tool call whose command fixes the bug, then an answer.
    (scripted,), bad = load_tasks(EXAMPLES.with_name("tasks-scripted.jsonl"), Overrides())
    assert bad == [] and scripted.request.agent.harness == "qwen-code"
    forced = [turn["vllm_xargs"] for turn in scripted.request.engine.turns]
    assert len(forced) == 2 and "run_shell_command" in forced[0]["rollwire_forced_text"]
    # The forced ids are the tiny model's template tokens for the text beside them, up to <|im_end|>.
    for turn in forced:
        assert turn["rollwire_forced_tokens"] == turn_token_ids(turn["rollwire_forced_text"])
    call = forced[0]["rollwire_forced_text"]
    command = json.loads(call.split("\n")[1])["arguments"]["command"]
    work = tmp_path / "scripted"
    shutil.copytree(Path(scripted.request.runtime.repo or ""), work)
    subprocess.run(["sh", "-c", command], cwd=work, check=True, timeout=30)
    run = subprocess.run([sys.executable, "-m", "unittest", "-q"], cwd=work, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


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
    # task, sessions, completed, failed policy, failed infra, failed unknown, retries, not ended, completions,
    # trajectories, traces per session, reward, passed, then mean seconds per stage (init 3.0 over two
    # sessions, running 3.5).
    assert cells[:13] == ["demo", "3", "1", "1", "1", "0", "0", "0", "3", "1", "0.00", "0.50 (2)", "1/2"]
    assert cells[13:15] == ["3.0", "-"] and cells[15] == "3.5"
    assert rollout_job.exit_code([status]) == 1  # one infrastructure failure

    # Rewards per session with each sample's advantage from the task's group, and the groups table.
    group = Group(task_id=task_id, evaluator="tests", baseline_mean=1.0, baseline_std=0.0, no_signal=True, samples=[
        GroupSample(session_id=a, reward=1.0, advantage=0.0, in_baseline=True),
        GroupSample(session_id=b, reward=0.0, advantage=0.0, in_baseline=False, status=SessionStatus.ERROR),
        GroupSample(session_id=c, advantage=None, in_baseline=False, failure=FailureKind.INFRASTRUCTURE)])
    sessions = _render(sessions_table([status], {task_id: group}))
    cells = {row.strip("│ ").split("│")[0].strip(): [c.strip() for c in row.strip("│ ").split("│")[1:]]
             for row in sessions.splitlines() if row.startswith("│")}
    assert cells[a] == ["completed", "0", "3", "0 traces", "1.00", "yes", "+0.000"], cells
    assert cells[b][4:] == ["0.00", "no", "+0.000 (failed)"] and cells[c][6] == "none (infra)", cells
    assert "no group" in _render(sessions_table([status], {}))
    table = _render(groups_table([status], {task_id: group}))
    assert "1.00 0.00 -" in table and "none (equal rewards)" in table, table
    assert "not yet: 2 sessions have no trajectory" in _render(groups_table([status], {}))
    assert "1/2 accepted = 50.0%" in acceptance_line({"evaluator": "tests", "min_reward": 1.0, "attempted": 2,
                                                      "accepted": 1, "acceptance_rate": 0.5, "rows": 1}).plain


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


HARNESS = """
import json, pathlib, sys, urllib.request
base_url, api_key, model, session_id = sys.argv[1:5]
messages = [{"role": "user", "content": "Fix calc.py so that the tests pass."}]
for turn in range(2):  # two model calls through the proxy, the second continuing the first
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 8}).encode()
    request = urllib.request.Request(base_url + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + api_key, "Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]
    messages += [{"role": "assistant", "content": reply.get("content") or ""},
                 {"role": "user", "content": "Go on."}]
if session_id.endswith("-s0"):  # only the first sample fixes the bug: the group has a reward spread
    pathlib.Path("calc.py").write_text("def add(a, b):\\n    return a + b\\n")
"""


def _task_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "test_calc.py").write_text("import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
                                       "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    return repo


def _page_when_it_shows(summary: str, session_id: str, timeout_s: float = 60) -> str:
    """The session page the summary links, once the web page's view has read the session's calls."""
    import time

    import httpx

    url = next(line.split()[-1] for line in summary.splitlines() if line.strip().startswith("session")
               and line.rstrip().endswith(f"/sessions/{session_id}"))
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(url, timeout=10)
        if response.status_code == 200 and response.text.count('<tr class="call ') >= 2:
            return response.text
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}: {response.status_code} {response.text[:2000]}")
        time.sleep(0.5)


def test_job_runs_sessions_and_delivers_rewards_groups_and_sft(kafka_bootstrap: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole job in a private home and topic prefix over the stand-in engine: it starts a proxy,
    processors, a rollout server, a gateway node, the `tests` evaluator and the groups worker, runs a
    `command` harness (two model calls; sample 0 fixes the bug, sample 1 does not) and reports rewards,
    the group with its advantages, the acceptance rate and an SFT dataset that `datasets` loads."""
    import datasets

    from deploy.job_results import read_groups
    from deploy.services import ServiceProcess
    from schemas.transport.admin import delete_topics

    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({
        "task_id": "job", "instruction": "fix calc.py", "num_samples": 2, "timeout_s": 120,
        "runtime": {"kind": "local", "repo": str(_task_repo(tmp_path))},
        "agent": {"harness": "command", "command": f"{sys.executable} {script} {{base_url}} {{api_key}} "
                                                   "{model} {session_id}"},
        "evaluator": {"name": "tests", "settings": {"command": f"{sys.executable} -m unittest -q",
                                                    "timeout_s": 60}}}) + "\n")
    home = tmp_path / "home"
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=8))) as engine_url:
        for name, value in {"ROLLWIRE_HOME": str(home), "ROLLWIRE_KAFKA_BOOTSTRAP": kafka_bootstrap,
                            "ROLLWIRE_TOPIC_PREFIX": f"j{uuid.uuid4().hex[:8]}.", "ROLLWIRE_ENGINE_URL": engine_url,
                            "ROLLWIRE_PROXY_PORT": str(free_port()), "ROLLWIRE_PROCESSORS_PORT": str(free_port()),
                            "ROLLWIRE_PROCESSORS_STORE": "memory", "ROLLWIRE_ROLLOUT_PORT": str(free_port()),
                            "ROLLWIRE_GATEWAY_PORT": str(free_port()), "ROLLWIRE_GROUPS_PORT": str(free_port()),
                            "ROLLWIRE_GROUPS_STORE": "memory", "ROLLWIRE_SESSION_PARTITIONS": "2",
                            "ROLLWIRE_UI_PORT": str(free_port()),
                            "ROLLWIRE_TASK_PARTITIONS": "1"}.items():
            monkeypatch.setenv(name, value)
        console = Console(record=True, width=220, color_system=None)
        kafka = KafkaSettings()
        try:
            code = rollout_job.run_job(rollout_job.JobOptions(tasks_file=tasks, timeout_s=240, live=False), console)
            task_id = next(line.split("/v1/tasks/")[1].split("/")[0] for line in console.export_text(clear=False).splitlines()
                           if "/v1/tasks/job-r" in line)
            groups = asyncio.run(read_groups(kafka, [task_id], [task_id], 0))
            page = _page_when_it_shows(console.export_text(clear=False), f"{task_id}-s0")
        finally:
            for base_service in ("proxy", "processors", "ui"):  # the base stack stays up after a job: stop it here
                ServiceProcess(name=base_service, args=(), health_url=None).stop()
            asyncio.run(delete_topics(kafka_bootstrap, kafka.topic_prefix))  # the workers' own topics too
    text = console.export_text()
    for part in ("proxy", "processors", "ui", "rollout-server", "gateway-node", "evaluator tests", "groups"):
        assert f"{part:<16} started" in text, text
    # The summary links the run's page and each session's, and the session's page shows its calls.
    run_id = task_id.rsplit("-r", 1)[1]
    assert f"/runs/{run_id}" in text and f"/sessions/{task_id}-s1" in text, text
    assert "<h2>Calls</h2>" in page and page.count('<tr class="call ') == 2, page[:4000]
    assert "stopped groups" in text and "stopped gateway-node" in text, text
    assert code == 0, text
    assert "submitted 1 tasks, 2 sessions" in text and "rollout summary" in text, text
    # Rewards per session: sample 0 passed, sample 1 did not.
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.startswith("│ job-r")}
    s0, s1 = (rows[f"{task_id}-s{i}"] for i in (0, 1))
    # columns: status, retries, completions, trajectory, reward, passed, advantage
    assert s0[0] == "completed" and s0[1] == "0" and s0[2] == "2" and s0[4:6] == ["1.00", "yes"], s0
    assert s1[4:6] == ["0.00", "no"], s1
    # The group: both samples, advantages of opposite signs, on `groups` and in the table.
    group = groups[task_id]
    advantages = {x.session_id: x.advantage for x in group.samples}
    assert advantages[f"{task_id}-s0"] > 0 > advantages[f"{task_id}-s1"], group
    assert not group.no_signal and group.evaluator == "tests"
    assert s0[6] == f"{advantages[task_id + '-s0']:+.3f}", s0
    assert "acceptance (tests, reward >= 1.0): 1/2 accepted = 50.0%" in text, text
    # The SFT output: sample 0's trajectory, in chat-messages form, loaded by `datasets`.
    (sft,) = home.glob("runs/*/sft/sft.jsonl")
    assert str(sft) in text and str(sft.with_suffix(".parquet")) in text, text
    rows = datasets.load_dataset("json", data_files=str(sft), split="train")
    assert rows.num_rows >= 1 and set(rows["session_id"]) == {f"{task_id}-s0"}
    first = rows[0]
    assert first["reward"] == 1.0 and first["evaluator"] == "tests"
    assert [m["role"] for m in first["messages"]][:2] == ["user", "assistant"]
    assert len(first["token_ids"]) == len(first["loss_mask"]) > 0 and any(first["loss_mask"])
    parquet = datasets.load_dataset("parquet", data_files=str(sft.with_suffix(".parquet")), split="train")
    assert parquet.num_rows == rows.num_rows
