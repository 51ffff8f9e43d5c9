"""The rollout server on the real broker: validation, expansion into sessions, status derived from
session events, callbacks retried with backoff, a restart that rebuilds its view, and `rollwire submit`."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from producers.rollout import cli as rollout_cli
from producers.rollout.errors import InvalidTask
from producers.rollout.expand import check_policy_version, check_request, expand
from schemas.evaluations import Evaluation
from schemas.sessions import FailureKind, SessionEnded, SessionSpec, SessionStage, SessionStageChanged, SessionStatus
from schemas.tasks import AgentSpec, TaskAccepted, TaskRequest
from schemas.topics import Topic
from schemas.trajectories import Trajectory, TrajectoryStats
from schemas.transport import KafkaSettings
from tests.processors.factory import make_call
from tests.producers.rollout_helpers import (
    CallbackReceiver,
    publish,
    read_topic,
    rollout_server,
    task_body,
    task_status,
    wait_until,
)
from tests.servers import free_port, serve

pytestmark = pytest.mark.kafka


def _post(url: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/tasks", json=body, timeout=30)


def _locs(response: httpx.Response) -> list[list[object]]:
    return [d["loc"] for d in response.json()["detail"]]


async def test_bad_requests_are_refused_with_the_field(kafka: KafkaSettings, tmp_path: Path) -> None:
    with rollout_server(kafka, tmp_path) as url:
        cases: list[tuple[dict, list[object]]] = [
            ({"task_id": "t1", "instruction": "x"}, ["body", "agent"]),
            (task_body("t2", agent={"harness": "notepad"}), ["body", "agent", "harness"]),
            (task_body("t3", samples=0), ["body", "num_samples"]),
            (task_body("t4", instruction=""), ["body", "instruction"]),
            (task_body("t5", agent={"harness": "command"}), ["body", "agent"]),
            (task_body("t6", surprise=1), ["body", "surprise"]),
            (task_body("bad/id"), ["body", "task_id"]),
            (task_body("t8", callback_url="ftp://example.invalid/x"), ["body", "callback_url"]),
            (task_body("t9", runtime={"kind": "docker"}), ["body", "runtime"]),
            # a policy version floor written like a version that is none.
            *[(task_body(f"t10-{i}", policy_version=bad), ["body", "policy_version"])
              for i, bad in enumerate(BAD_FLOORS[:3])],
        ]
        for body, loc in cases:
            response = _post(url, body)
            assert response.status_code == 422, (body, response.text)
            assert any(got[:len(loc)] == loc for got in _locs(response)), (loc, response.text)
        # Nothing of a refused task reached Kafka: the task list is empty.
        assert httpx.get(f"{url}/v1/tasks", timeout=10).json() == []


BAD_FLOORS = ["v-1", "v", "-3", "V7", "1.5", "+4", "v12345678901234567890"]


@pytest.mark.parametrize("bad", BAD_FLOORS)
def test_a_malformed_policy_version_floor_is_refused(bad: str) -> None:
    with pytest.raises(InvalidTask) as refused:
        check_request(TaskRequest(instruction="x", agent=AgentSpec(harness="codex"), policy_version=bad))
    assert refused.value.field == ("body", "policy_version")


@pytest.mark.parametrize("given, floor", [("7", 7), ("v7", 7), (" 12 ", 12), ("0", 0), ("step-12", None),
                                          ("main", None), (None, None)])
def test_a_policy_version_is_a_floor_or_a_label_and_reaches_every_session(given: str | None,
                                                                          floor: int | None) -> None:
    """A version number is a floor the proxy enforces; a label (``step-12``) is kept, sets none; both are
    passed unchanged onto every session's spec."""
    request = TaskRequest(task_id="t-floor", instruction="x", num_samples=3, agent=AgentSpec(harness="codex"),
                          policy_version=given)
    check_request(request)
    assert check_policy_version(given) == floor
    _, specs = expand(request)
    assert [s.policy_version for s in specs] == [given] * 3


async def test_task_becomes_accepted_event_and_one_spec_per_sample(kafka: KafkaSettings, tmp_path: Path) -> None:
    body = task_body("task-a", samples=3, group_id="g-1", policy_version="v7", builder="per_request",
                     timeout_s=120, evaluator={"name": "tests", "settings": {"command": "true"}},
                     engine={"temperature": 0.5, "max_tokens": 64}, metadata={"origin": "test"})
    with rollout_server(kafka, tmp_path) as url:
        response = _post(url, body)
        assert response.status_code == 202, response.text
        answer = response.json()
        assert answer["task_id"] == "task-a"
        assert len(answer["session_ids"]) == 3 == len(set(answer["session_ids"]))

        duplicate = _post(url, body)
        assert duplicate.status_code == 409, duplicate.text

        status = task_status(url, "task-a")
        assert status["state"] == "pending"
        assert status["stages"] == {"queued": 3}

    (accepted,) = await read_topic(kafka, Topic.TASKS, 1)
    assert isinstance(accepted, TaskAccepted)
    assert accepted.session_ids == answer["session_ids"]
    specs = await read_topic(kafka, Topic.SESSIONS, 3)
    assert len(specs) == 3
    assert all(isinstance(s, SessionSpec) for s in specs)
    by_index = sorted(specs, key=lambda s: s.sample_index)
    assert [s.session_id for s in by_index] == answer["session_ids"]
    assert [s.sample_index for s in by_index] == [0, 1, 2]
    keys = [s.api_key for s in specs]
    assert all(keys) and len(set(keys)) == 3
    for spec in specs:
        assert (spec.task_id, spec.group_id, spec.policy_version, spec.builder) == ("task-a", "g-1", "v7", "per_request")
        assert spec.timeout_s == 120 and spec.evaluator is not None and spec.evaluator.name == "tests"
        assert spec.engine.temperature == 0.5 and spec.engine.max_tokens == 64
        assert spec.instruction == body["instruction"] and spec.agent is not None
        assert spec.agent.harness == "qwen-code" and spec.metadata == {"origin": "test"}


async def _run_sessions(kafka: KafkaSettings, task_id: str, session_ids: list[str], *, evaluate: bool) -> None:
    """What a gateway node, the proxy, the processors and an evaluator would write for the sessions:
    sample 0 completes with two model calls, sample 1 fails on the infrastructure."""
    first, second = session_ids
    await publish(kafka,
                  SessionStageChanged(session_id=first, task_id=task_id, stage=SessionStage.INIT, node="n1"),
                  SessionStageChanged(session_id=first, task_id=task_id, stage=SessionStage.RUNNING, node="n1",
                                      elapsed_s=1.5),
                  make_call(0, [1, 2], [3], session_id=first), make_call(1, [1, 2, 3, 4], [5], session_id=first),
                  SessionStageChanged(session_id=second, task_id=task_id, stage=SessionStage.INIT, node="n2"))
    await publish(kafka,
                  SessionEnded(session_id=first, task_id=task_id, status=SessionStatus.COMPLETED, exit_code=0,
                               patch="diff --git a/x b/x\n", timings={"init": 1.5, "running": 4.0}),
                  SessionEnded(session_id=second, task_id=task_id, status=SessionStatus.ERROR,
                               failure=FailureKind.INFRASTRUCTURE, reason="checkout failed"),
                  Trajectory(session_id=first, task_id=task_id, builder="prefix_merging", traces=[],
                             stats=TrajectoryStats(completions=2)))
    if evaluate:
        await publish(kafka, Evaluation(session_id=first, task_id=task_id, evaluator="tests", reward=1.0,
                                        passed=True))


async def test_status_is_derived_from_session_events(kafka: KafkaSettings, tmp_path: Path) -> None:
    with rollout_server(kafka, tmp_path, evaluation_wait_s=3600) as url:
        answer = _post(url, task_body("task-s", evaluator={"name": "tests"})).json()
        first, second = answer["session_ids"]
        await _run_sessions(kafka, "task-s", answer["session_ids"], evaluate=False)

        status = wait_until(lambda: (s := task_status(url, "task-s"))["stages"].get("ended") == 2
                            and s["sessions"][0]["completions"] == 2 and "trajectory_id" in s["sessions"][0]
                            and s, what="both sessions ended, their completions and trajectory read")
        # Ended, but sample 0 still waits for its evaluation (sample 1 failed on the infrastructure:
        # nothing of the policy's to score).
        assert status["state"] == "evaluating"
        s0, s1 = status["sessions"]
        assert (s0["session_id"], s0["status"], s0["node"], s0["exit_code"]) == (first, "completed", "n1", 0)
        assert s0["timings"] == {"init": 1.5, "running": 4.0}
        assert s0["completions"] == 2 and s0["patch_bytes"] > 0
        assert s0["trajectory_id"] and s0["traces"] == 0
        assert (s1["session_id"], s1["status"], s1["failure"], s1["reason"]) == (
            second, "error", "infrastructure", "checkout failed")
        assert s1["stage"] == "init" and "trajectory_id" not in s1
        assert httpx.get(f"{url}/v1/tasks/task-s/result", timeout=10).status_code == 202

        await publish(kafka, Evaluation(session_id=first, task_id="task-s", evaluator="tests", reward=1.0, passed=True))
        done = wait_until(lambda: (s := task_status(url, "task-s"))["state"] == "done" and s, what="task done")
        assert done["sessions"][0]["reward"] == 1.0
        result = httpx.get(f"{url}/v1/tasks/task-s/result", timeout=10)
        assert result.status_code == 200
        assert result.json()["complete"] is True and result.json()["mean_reward"] == 1.0
        assert httpx.get(f"{url}/v1/tasks/nope", timeout=10).status_code == 404


async def test_callback_retried_until_a_flaky_receiver_accepts(kafka: KafkaSettings, tmp_path: Path) -> None:
    receiver = CallbackReceiver(failures=2)
    dead_url = f"http://127.0.0.1:{free_port()}/results"  # nothing listens: every attempt fails
    with serve(receiver.app()) as receiver_url, rollout_server(kafka, tmp_path, callback_attempts=5) as url:
        dead = _post(url, task_body("task-dead", callback_url=dead_url)).json()
        flaky = _post(url, task_body("task-cb", callback_url=f"{receiver_url}/results")).json()
        await _run_sessions(kafka, "task-dead", dead["session_ids"], evaluate=False)
        await _run_sessions(kafka, "task-cb", flaky["session_ids"], evaluate=False)

        wait_until(lambda: receiver.bodies, what="the callback to be delivered")
        assert receiver.attempts == 3
        (body,) = receiver.bodies
        assert body["task_id"] == "task-cb" and [s["session_id"] for s in body["sessions"]] == flaky["session_ids"]
        assert body["sessions"][0]["status"] == "completed" and body["complete"] is True
        callback = task_status(url, "task-cb")["callback"]
        assert (callback["state"], callback["attempts"]) == ("delivered", 3)

        failed = wait_until(lambda: (c := task_status(url, "task-dead")["callback"])["state"] == "failed" and c,
                            what="the dead callback to give up")
        assert failed["attempts"] == 5 and "Connect" in failed["last_error"]


async def test_restart_rebuilds_status_and_remembers_callbacks(kafka: KafkaSettings, tmp_path: Path) -> None:
    receiver = CallbackReceiver(failures=0)
    with serve(receiver.app()) as receiver_url:
        with rollout_server(kafka, tmp_path) as url:
            answer = _post(url, task_body("task-r", callback_url=f"{receiver_url}/results")).json()
            await _run_sessions(kafka, "task-r", answer["session_ids"], evaluate=False)
            # Done, and the trajectory and both completions read (the task does not wait for those).
            before = wait_until(lambda: (s := task_status(url, "task-r"))["state"] == "done"
                                and s["sessions"][0].get("trajectory_id") and s["sessions"][0]["completions"] == 2
                                and s, what="done")
            wait_until(lambda: task_status(url, "task-r")["callback"]["state"] == "delivered",
                       what="callback delivered")
            assert len(receiver.bodies) == 1

        with rollout_server(kafka, tmp_path) as url:
            after = task_status(url, "task-r")
            assert after["sessions"] == before["sessions"]
            assert after["state"] == "done" and after["callback"]["state"] == "delivered"
            assert _post(url, task_body("task-r")).status_code == 409
        assert receiver.attempts == 1  # the restarted server knew the result was delivered


async def test_submit_posts_good_lines_and_reports_bad_ones(kafka: KafkaSettings, tmp_path: Path) -> None:
    repo = tmp_path / "repos" / "fix-it"
    repo.mkdir(parents=True)
    run = uuid.uuid4().hex[:6]
    lines = [
        json.dumps(task_body(f"sub-1-{run}", samples=1, runtime={"repo": "repos/fix-it"})),
        "{not json",
        "",
        json.dumps(task_body(f"sub-2-{run}", agent={"harness": "notepad"})),
        json.dumps(task_body(f"sub-3-{run}", samples=1)),
    ]
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("\n".join(lines) + "\n")
    app = typer.Typer()
    app.command()(rollout_cli.submit)
    with rollout_server(kafka, tmp_path / "state") as url:
        result = CliRunner().invoke(app, [str(tasks_file), "--server", url, "--samples", "2"])
    assert result.exit_code == 1, result.output
    assert f"line 1: task sub-1-{run}: sub-1-{run}-s0 sub-1-{run}-s1" in result.stdout
    assert f"line 5: task sub-3-{run}: sub-3-{run}-s0 sub-3-{run}-s1" in result.stdout
    assert "line 2: error: not JSON" in result.stderr
    assert "line 4: error: agent.harness" in result.stderr
    specs = await read_topic(kafka, Topic.SESSIONS, 4)
    assert len(specs) == 4
    repos = {s.session_id: s.runtime.repo for s in specs}
    assert repos[f"sub-1-{run}-s0"] == str(repo.resolve())
