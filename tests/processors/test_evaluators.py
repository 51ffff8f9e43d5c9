"""Evaluators: the `tests` evaluator on a tiny task repository, and the runner end to end.

The `tests` evaluator must give 1 for a patch that fixes the task, 0 for one that does not, 0 for an empty
patch and 0 (with git's reason) for a patch that does not apply to the base commit; its checkout must be
fresh each time (a session's patch never leaks into the next). The runner must score, in its own consumer
group on the real broker, only the sessions whose spec names it, while a second evaluator run with
``--all`` through the real ``rollwire evaluator run`` command scores the same sessions independently.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from processors.evaluators import EVALUATORS, TestsEvaluator, evaluator_class
from processors.evaluators.base import evaluation_event_id
from processors.evaluators.runner import EvaluatorRunner
from processors.evaluators.session_completed import SessionCompleted
from schemas.evaluations import Evaluation
from schemas.sessions import FailureKind, SessionEnded, SessionSpec, SessionStatus
from schemas.tasks import EvaluatorSpec, RuntimeSpec
from schemas.topics import Topic
from schemas.transport import EventProducer
from tests.processors.worker_process import read_events

ROOT = Path(__file__).resolve().parents[2]
TASK_REPO = ROOT / "tests" / "fixtures" / "tasks" / "calc"
SETTINGS = {"command": f"{sys.executable} -m unittest -q check_calc", "timeout_s": 60}
FIXED = 'def add(a: int, b: int) -> int:\n    return a + b\n'
WRONG = 'def add(a: int, b: int) -> int:\n    return a * b\n'


def make_patch(tmp_path: Path, old: str, new: str, path: str = "calc.py") -> str:
    """The git diff a session would end with after replacing ``old`` by ``new`` in the task repository."""
    work = tmp_path / f"work-{uuid.uuid4().hex[:6]}"
    shutil.copytree(TASK_REPO, work, ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=work, check=True)
    subprocess.run([*git, "add", "-A"], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=work, check=True)
    target = work / path
    target.write_text(target.read_text().replace(old, new))
    return subprocess.run([*git, "diff"], cwd=work, check=True, capture_output=True, text=True).stdout


def spec_for(session_id: str, evaluator: str = "tests", settings: dict | None = None) -> SessionSpec:
    return SessionSpec(session_id=session_id, task_id="task-calc", runtime=RuntimeSpec(repo=str(TASK_REPO)),
                       evaluator=EvaluatorSpec(name=evaluator, settings=SETTINGS if settings is None else settings))


def ended(session_id: str, patch: str | None, status: SessionStatus = SessionStatus.COMPLETED) -> SessionEnded:
    return SessionEnded(session_id=session_id, task_id="task-calc", status=status, patch=patch)


BUGGY = 'def add(a: int, b: int) -> int:\n    return a - b\n'


@pytest.fixture(scope="module")
def patches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("patches")
    stale = make_patch(tmp, "def double(a: int) -> int:\n    return 2 * a\n",
                       "def double(a: int) -> int:\n    return a + a\n")
    return {
        "correct": make_patch(tmp, BUGGY, FIXED),
        "wrong": make_patch(tmp, BUGGY, WRONG),
        # Made against another version of calc.py: its context lines are not in the base commit.
        "stale": stale.replace("return 2 * a", "return 3 * a"),
    }


def test_registry_names_the_shipped_evaluators() -> None:
    assert set(EVALUATORS) >= {"session_completed", "tests"}
    assert evaluator_class("tests") is TestsEvaluator
    with pytest.raises(Exception, match="known: harbor, judge, session_completed, swebench, tests"):
        evaluator_class("nope")


async def test_correct_patch_scores_one(patches: dict[str, str], tmp_path: Path) -> None:
    evaluation = await TestsEvaluator(scratch=tmp_path).evaluate(ended("s1", patches["correct"]), spec_for("s1"))
    assert evaluation.status == "ok" and evaluation.reward == 1.0 and evaluation.passed, evaluation.details
    assert evaluation.details["exit_code"] == 0 and evaluation.evaluator_version == "1"
    assert evaluation.task_id == "task-calc"
    assert list(tmp_path.iterdir()) == []  # the checkout is removed afterwards


async def test_wrong_patch_scores_zero(patches: dict[str, str], tmp_path: Path) -> None:
    evaluation = await TestsEvaluator(scratch=tmp_path).evaluate(ended("s2", patches["wrong"]), spec_for("s2"))
    assert evaluation.status == "ok" and evaluation.reward == 0.0 and evaluation.passed is False
    assert evaluation.details["exit_code"] != 0 and "tests failed" in evaluation.details["reason"]
    assert "FAIL: test_add" in evaluation.details["output"]


@pytest.mark.parametrize("patch", [None, "", "\n"])
async def test_empty_patch_scores_zero(patch: str | None) -> None:
    evaluation = await TestsEvaluator().evaluate(ended("s3", patch), spec_for("s3"))
    assert evaluation.reward == 0.0 and evaluation.passed is False
    assert "empty patch" in evaluation.details["reason"]


async def test_patch_that_does_not_apply_scores_zero_with_reason(patches: dict[str, str]) -> None:
    evaluation = await TestsEvaluator().evaluate(ended("s4", patches["stale"]), spec_for("s4"))
    assert evaluation.status == "ok" and evaluation.reward == 0.0
    reason = evaluation.details["reason"]
    assert reason.startswith("patch does not apply") and "calc.py" in reason, reason
    garbage = await TestsEvaluator().evaluate(ended("s4b", "this is not a diff\n"), spec_for("s4b"))
    assert garbage.reward == 0.0 and garbage.details["reason"].startswith("patch does not apply")


async def test_a_hanging_test_run_is_killed_at_its_timeout(tmp_path: Path) -> None:
    settings = {"command": "sleep 30", "timeout_s": 1}
    patch = make_patch(tmp_path, BUGGY, FIXED)
    evaluation = await TestsEvaluator().evaluate(ended("s5", patch), spec_for("s5", settings=settings))
    assert evaluation.reward == 0.0 and evaluation.details["timed_out"] is True
    assert evaluation.details["duration_s"] < 20


async def test_a_docker_task_is_scored_locally_where_no_engine_answers(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")  # no engine answers there
    spec = spec_for("s9", settings={"command": "grep -q 'a + b' calc.py", "timeout_s": 30})
    spec = spec.model_copy(update={"runtime": RuntimeSpec(kind="docker", image="python:3.11-slim",
                                                          repo=str(TASK_REPO))})
    evaluation = await TestsEvaluator().evaluate(ended("s9", make_patch(tmp_path, BUGGY, FIXED)), spec)
    assert evaluation.reward == 1.0, evaluation
    assert evaluation.details["runtime"].startswith("local (runtime is docker but no Docker engine answers")


async def test_missing_command_or_repository_is_the_evaluators_error(patches: dict[str, str]) -> None:
    no_command = await TestsEvaluator().evaluate(ended("s6", patches["correct"]), spec_for("s6", settings={}))
    assert no_command.status == "error" and no_command.reward is None and "settings.command" in no_command.error
    spec = spec_for("s7").model_copy(update={"runtime": RuntimeSpec(repo="/nonexistent/repo")})
    no_repo = await TestsEvaluator().evaluate(ended("s7", patches["correct"]), spec)
    assert no_repo.status == "error" and "git clone" in no_repo.error


async def test_evaluation_ids_are_stable_per_session_end() -> None:
    end = ended("s8", None, status=SessionStatus.ERROR)
    first = await SessionCompleted().evaluate(end, None)
    again = await SessionCompleted().evaluate(end, None)
    assert first.event_id == again.event_id == evaluation_event_id("session_completed", "1", end)
    assert first.reward == 0.0
    other = await TestsEvaluator().evaluate(end, spec_for("s8"))
    assert other.event_id != first.event_id


def _cli_evaluator(kafka, name: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap, "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix,
           "ROLLWIRE_SESSION_PARTITIONS": str(kafka.session_partitions),
           "ROLLWIRE_TASK_PARTITIONS": str(kafka.task_partitions)}
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "evaluator", "run", name, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.mark.kafka
async def test_runner_end_to_end(kafka, patches: dict[str, str], tmp_path: Path) -> None:
    cases = {"e-correct": patches["correct"], "e-wrong": patches["wrong"], "e-empty": "", "e-stale": patches["stale"]}
    specs = [spec_for(sid) for sid in cases]
    specs.append(spec_for("e-other", evaluator="session_completed", settings={}))  # not for `tests`
    ends = [ended(sid, patch) for sid, patch in cases.items()]
    ends.append(ended("e-other", patches["correct"], status=SessionStatus.ERROR))
    ends.append(SessionEnded(session_id="e-crashed", status=SessionStatus.ERROR, failure=FailureKind.INFRASTRUCTURE))

    stop = asyncio.Event()
    runner = EvaluatorRunner(kafka, TestsEvaluator(scratch=tmp_path), concurrency=2)
    task = asyncio.create_task(runner.run(stop))
    cli = _cli_evaluator(kafka, "session_completed", "--all")
    try:
        async with EventProducer(kafka) as producer:
            await producer.send_many(specs)
            await producer.send_many(ends)
            # A redelivered end (same event id) must not be scored twice.
            await producer.send(ends[0])
        events = await read_events(kafka, Topic.EVALUATIONS, until=len(cases) + len(ends), timeout_s=90)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        cli.terminate()
        output = cli.communicate(timeout=30)[0].decode(errors="replace")
    assert all(isinstance(e, Evaluation) for e in events)
    by_evaluator: dict[str, dict[str, Evaluation]] = {}
    for event in events:
        assert isinstance(event, Evaluation)
        assert event.session_id not in by_evaluator.get(event.evaluator, {}), f"scored twice: {event}"
        by_evaluator.setdefault(event.evaluator, {})[event.session_id] = event
    tests = by_evaluator["tests"]
    assert {sid: e.reward for sid, e in tests.items()} == {"e-correct": 1.0, "e-wrong": 0.0, "e-empty": 0.0,
                                                          "e-stale": 0.0}, output
    assert tests["e-stale"].details["reason"].startswith("patch does not apply")
    completed = by_evaluator["session_completed"]
    assert set(completed) == {*cases, "e-other", "e-crashed"}, output
    assert completed["e-correct"].reward == 1.0 and completed["e-other"].reward == 0.0
    assert completed["e-crashed"].details["failure"] == "infrastructure"
    assert runner.counters == {"evaluated": 4, "errors": 0, "skipped": 2}


@pytest.mark.docker
async def test_a_repo_less_docker_task_is_scored_in_its_image(docker_images: list[str], tmp_path: Path) -> None:
    """A docker spec without ``repo`` (a SWE-style image whose /testbed is the workspace): the session's
    patch and the hidden test patch are applied inside a fresh container with no network (no relay
    directory mounted); a fixing patch scores 1, a patch that fixes nothing 0 (tests fail), a stale one 0
    (git's reason); no container is left behind."""
    from producers.runtimes.docker import docker_client
    from producers.runtimes.reaper import SESSION_LABEL
    from schemas.swebench import read_instances, to_task_request

    records, bad = read_instances(ROOT / "examples" / "swebench" / "instances.jsonl")
    assert not bad
    instance = next(r.instance for r in records if r.instance.instance_id == "rollwire__textstats-1")
    assert instance.image in docker_images and instance.patch is not None
    request = to_task_request(instance, harness="command", command="true")
    assert request.runtime.repo is None and request.runtime.kind == "docker"
    settings = {"command": "test ! -e /rollwire/run && python3 -m pytest -q -p no:cacheprovider tests/test_words.py",
                "test_patch": instance.test_patch, "timeout_s": 120}
    buggy = '    return len(text.split(" "))'
    patches = {"gold": instance.patch,
               "nothing": instance.patch.replace("+    return len(text.split())\n", f"+{buggy}  # fixed?\n"),
               "stale": instance.patch.replace(f"-{buggy}\n", "-    return len(text.split(','))\n")}
    client = docker_client()
    evaluator = TestsEvaluator(scratch=tmp_path / "scratch")
    results: dict[str, Evaluation] = {}
    for name, patch in patches.items():
        session_id = f"docker-{name}-{uuid.uuid4().hex[:8]}"
        spec = SessionSpec(session_id=session_id, task_id=request.task_id, runtime=request.runtime,
                           evaluator=EvaluatorSpec(name="tests", settings=settings))
        results[name] = await evaluator.evaluate(ended(session_id, patch), spec)
        left = client.containers.list(all=True, ignore_removed=True,
                                      filters={"label": f"{SESSION_LABEL}=eval-{session_id}"})
        assert left == [], f"containers left behind: {[c.name for c in left]}"
    gold, nothing, stale = results["gold"], results["nothing"], results["stale"]
    assert gold.status == "ok" and gold.reward == 1.0 and gold.passed, gold.details
    assert gold.details["runtime"] == "docker" and gold.details["patch_applied_in"] == "container"
    assert gold.details["base_commit"] == instance.base_commit
    assert "5 passed" in gold.details["output"]  # the hidden tests (test_patch) ran too
    assert nothing.status == "ok" and nothing.reward == 0.0 and nothing.passed is False, nothing.details
    assert "tests failed" in nothing.details["reason"] and "2 failed" in nothing.details["output"]
    assert stale.status == "ok" and stale.reward == 0.0, stale.details
    reason = stale.details["reason"]
    assert reason.startswith("patch does not apply") and "textstats/words.py" in reason, reason
    assert list((tmp_path / "scratch").iterdir()) == []
