"""The `swebench` evaluator on real containers of the example task images.

Each grading starts a fresh container of the instance's image (built by `rollwire images build`, i.e.
deploy.images, when missing), applies the session's patch there, then the hidden test patch, runs the
listed tests and reads pytest's -rA summary. The gold patch must resolve every example; a patch that
changes no code must leave exactly the FAIL_TO_PASS tests failing; an empty patch, a patch that breaks a
PASS_TO_PASS test, a patch that applies neither way, a listed test that never runs and a test run past its
timeout must score 0 and say why; a patch whose context `git apply` refuses must be applied by `patch
--fuzz` and say so; edits to the hidden tests' files must not count; a test patch that does not apply, a
missing image and a missing engine are the evaluator's errors, not the policy's. After every grading no
container of it is left, and its scratch folder is gone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from processors.evaluators import EVALUATORS, evaluator_class
from processors.evaluators.swebench import (
    SwebenchEvaluator,
    listed_test_files,
    outcomes_for,
    parse_summary,
    patch_paths,
)
from producers.runtimes.docker import docker_client
from producers.runtimes.reaper import SESSION_LABEL
from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.swebench import SwebenchInstance, read_instances, to_task_request

ROOT = Path(__file__).resolve().parents[2]
INSTANCES = ROOT / "examples" / "swebench" / "instances.jsonl"
WORDS = "tests/test_words.py"
BUGGY_LINE = '    return len(text.split(" "))'


def examples() -> dict[str, SwebenchInstance]:
    records, bad = read_instances(INSTANCES)
    assert not bad
    return {r.instance.instance_id: r.instance for r in records}


@pytest.fixture(scope="module")
def client(docker_engine: str) -> Any:
    return docker_client()


@pytest.fixture(scope="module")
def images(docker_images: list[str]) -> dict[str, SwebenchInstance]:
    """The example instances; their images are on the engine (tests/conftest.py builds them)."""
    instances = examples()
    assert {i.image for i in instances.values()} <= set(docker_images)
    return instances


@pytest.fixture
def evaluator(tmp_path: Path) -> SwebenchEvaluator:
    return SwebenchEvaluator(scratch=tmp_path / "scratch")


def words_patch(instance: SwebenchInstance, new_line: str) -> str:
    """The gold patch with its one added line replaced by ``new_line`` (same context, same hunk)."""
    assert instance.patch is not None
    return instance.patch.replace("+    return len(text.split())\n", f"+{new_line}\n")


async def grade(evaluator: SwebenchEvaluator, client: Any, instance: SwebenchInstance, patch: str | None,
                **settings: Any) -> Evaluation:
    """Grade ``patch`` as a session of ``instance``'s task would be; check nothing of it is left."""
    request = to_task_request(instance, harness="qwen-code")
    assert request.evaluator is not None
    session_id = f"{instance.instance_id}-{uuid.uuid4().hex[:8]}"
    spec = SessionSpec(session_id=session_id, task_id=request.task_id, runtime=request.runtime,
                       evaluator=request.evaluator.model_copy(update={
                           "settings": {**request.evaluator.settings, **settings}}))
    ended = SessionEnded(session_id=session_id, task_id=request.task_id, status=SessionStatus.COMPLETED, patch=patch)
    evaluation = await evaluator.evaluate(ended, spec)
    assert evaluation.session_id == session_id and evaluation.evaluator == "swebench"
    assert evaluation.evaluator_version == "1"
    left = client.containers.list(all=True, ignore_removed=True,
                                  filters={"label": f"{SESSION_LABEL}=swebench-eval-{session_id}"})
    assert left == [], f"containers left behind: {[c.name for c in left]}"
    if evaluator.scratch.exists():
        assert list(evaluator.scratch.iterdir()) == [], "the grading's scratch folder is left behind"
    return evaluation


def test_registered_under_its_name() -> None:
    assert evaluator_class("swebench") is SwebenchEvaluator and EVALUATORS["swebench"].version == "1"


def test_pytest_summary_lines_give_the_listed_tests_outcomes() -> None:
    output = "\n".join([
        "tests/a.py::test_ok PASSED", "=== short test summary info ===",
        "PASSED tests/a.py::test_ok", "FAILED tests/a.py::test_bad - assert 1 == 2",
        "PASSED tests/a.py::test_teardown", "ERROR tests/a.py::test_teardown - RuntimeError",
        "XFAIL tests/a.py::test_x - known", "SKIPPED [1] tests/a.py:9: no network",
        "FAILED tests/a.py::test_p[a - b] - assert False", "PASSED tests/a.py::test_ok2"])
    listed = ["tests/a.py::test_ok", "tests/a.py::test_bad", "tests/a.py::test_teardown", "tests/a.py::test_x",
              "tests/a.py::test_skipped", "tests/a.py::test_p[a - b]", "tests/a.py::test_o"]
    assert outcomes_for(listed, parse_summary(output)) == {
        "tests/a.py::test_ok": "passed", "tests/a.py::test_bad": "failed", "tests/a.py::test_teardown": "error",
        "tests/a.py::test_x": "xfail", "tests/a.py::test_skipped": "missing", "tests/a.py::test_p[a - b]": "failed",
        "tests/a.py::test_o": "missing"}
    assert listed_test_files(["t/a.py::x", "t/b.py::C::y[1]", "t/a.py::z", "t/c.py", "test_q (django.Tests)"]) == [
        "t/a.py", "t/b.py", "t/c.py"]
    assert patch_paths("diff --git a/t/a.py b/t/a.py\n--- a/t/a.py\n+++ b/t/a.py\n"
                       "diff --git a/t/old.py b/t/new.py\n") == ["t/a.py", "t/old.py", "t/new.py"]


@pytest.mark.parametrize("instance_id", sorted(examples()))
async def test_the_gold_patch_resolves_each_example(instance_id: str, images: dict[str, SwebenchInstance],
                                                    evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images[instance_id]
    evaluation = await grade(evaluator, client, instance, instance.patch)
    assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 1.0, True), evaluation.details
    details = evaluation.details
    assert details["resolved"] is True and details["patch_applied_by"] == "git apply"
    assert details["tests"] == {t: "passed" for t in [*instance.fail_to_pass, *instance.pass_to_pass]}
    assert details["fail_to_pass_failing"] == [] and details["pass_to_pass_failing"] == []
    assert details["exit_code"] == 0 and details["timed_out"] is False and details["image"] == instance.image


@pytest.mark.parametrize("instance_id", sorted(examples()))
async def test_a_patch_that_fixes_nothing_leaves_exactly_fail_to_pass_failing(
        instance_id: str, images: dict[str, SwebenchInstance], evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images[instance_id]
    readme = ("diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/README.md\n@@ -1 +1,3 @@\n"
              f"{' ' + open(ROOT / 'examples/swebench/repos' / instance_id / 'README.md').readline().rstrip()}\n"
              "+\n+A note.\n")
    evaluation = await grade(evaluator, client, instance, readme)
    assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 0.0, False), evaluation.details
    assert evaluation.details["fail_to_pass_failing"] == instance.fail_to_pass
    assert evaluation.details["pass_to_pass_failing"] == []
    assert "FAIL_TO_PASS" in evaluation.details["reason"]


async def test_an_empty_patch_scores_zero_with_its_reason(images: dict[str, SwebenchInstance],
                                                          evaluator: SwebenchEvaluator, client: Any) -> None:
    for patch in ("", None, "\n  \n"):
        evaluation = await grade(evaluator, client, images["rollwire__textstats-1"], patch)
        assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 0.0, False)
        assert evaluation.details["reason"].startswith("empty patch")


async def test_a_patch_that_breaks_a_pass_to_pass_test_is_not_resolved(images: dict[str, SwebenchInstance],
                                                                       evaluator: SwebenchEvaluator,
                                                                       client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    # Fixes both FAIL_TO_PASS tests, but a single word now counts as none.
    patch = words_patch(instance, "    return len(text.split()) if len(text.split()) > 1 else 0")
    evaluation = await grade(evaluator, client, instance, patch)
    assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 0.0, False), evaluation.details
    details = evaluation.details
    assert details["resolved"] is False and details["patch_applied_by"] == "git apply"
    assert details["pass_to_pass_failing"] == [f"{WORDS}::test_single_word"]
    assert details["fail_to_pass_failing"] == []
    assert details["tests"][f"{WORDS}::test_single_word"] == "failed"
    assert details["tests"][f"{WORDS}::test_sentence"] == "passed"
    assert "0 of 2 FAIL_TO_PASS and 1 of 3 PASS_TO_PASS" in details["reason"]
    assert "test_single_word" in details["output"]


async def test_a_patch_git_refuses_is_applied_with_fuzz_and_says_so(images: dict[str, SwebenchInstance],
                                                                    evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    assert instance.patch is not None and "@@ -3,7 +3,7 @@\n \n def word_count" in instance.patch
    # Made against a version two lines further down whose first context line differs: an offset and a fuzz.
    fuzzed = instance.patch.replace("@@ -3,7 +3,7 @@\n \n def word_count",
                                    "@@ -5,7 +5,7 @@\n # counting words\n def word_count")
    evaluation = await grade(evaluator, client, instance, fuzzed)
    assert (evaluation.status, evaluation.reward) == ("ok", 1.0), evaluation.details
    details = evaluation.details
    assert details["patch_applied_by"] == "patch --fuzz=3"
    assert "patch failed" in details["patch_apply_output"]["git apply"]
    assert "with fuzz 1" in details["patch_apply_output"]["patch --fuzz=3"]


async def test_a_patch_that_applies_neither_way_scores_zero(images: dict[str, SwebenchInstance],
                                                           evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    stale = words_patch(instance, "    return 0").replace(BUGGY_LINE, "    return len(text.split(','))")
    evaluation = await grade(evaluator, client, instance, stale.replace(" def word_count(text):", " def words(s):"))
    assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 0.0, False), evaluation.details
    assert evaluation.details["reason"].startswith("patch does not apply")
    assert set(evaluation.details["patch_apply_output"]) == {"git apply", "patch --fuzz=3"}
    assert "patch_applied_by" not in evaluation.details


async def test_edits_to_the_hidden_tests_files_do_not_count(images: dict[str, SwebenchInstance],
                                                            evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    # The session rewrote the test file where the hidden tests go (and fixed nothing): without putting the
    # file back, the test patch would not apply; with it, the hidden tests run and fail.
    patch = (f"diff --git a/{WORDS} b/{WORDS}\n--- a/{WORDS}\n+++ b/{WORDS}\n@@ -9,5 +9,9 @@ def test_sentence():\n"
             '     assert word_count("the quick brown fox") == 4\n \n \n+def test_multiple_spaces():\n+    pass\n+\n+\n'
             ' def test_line_count():\n     assert line_count("one\\ntwo\\n") == 2\n')
    evaluation = await grade(evaluator, client, instance, patch)
    assert (evaluation.status, evaluation.reward) == ("ok", 0.0), evaluation.details
    assert evaluation.details["fail_to_pass_failing"] == instance.fail_to_pass
    assert evaluation.details["tests"][f"{WORDS}::test_multiple_spaces"] == "failed"


async def test_a_listed_test_that_never_runs_is_missing(images: dict[str, SwebenchInstance],
                                                        evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    evaluation = await grade(evaluator, client, instance, instance.patch,
                             PASS_TO_PASS=[*instance.pass_to_pass, f"{WORDS}::test_gone"])
    assert (evaluation.status, evaluation.reward) == ("ok", 0.0), evaluation.details
    assert evaluation.details["tests"][f"{WORDS}::test_gone"] == "missing"
    assert evaluation.details["pass_to_pass_failing"] == [f"{WORDS}::test_gone"]


async def test_tests_past_their_timeout_score_zero(images: dict[str, SwebenchInstance],
                                                   evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    evaluation = await grade(evaluator, client, instance, instance.patch, test_cmd="sleep 60", timeout_s=2)
    assert (evaluation.status, evaluation.reward, evaluation.passed) == ("ok", 0.0, False), evaluation.details
    assert evaluation.details["timed_out"] is True and "within 2 s" in evaluation.details["reason"]
    assert evaluation.details["duration_s"] < 30


async def test_a_test_cmd_replaces_the_default_pytest_run(images: dict[str, SwebenchInstance],
                                                          evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    evaluation = await grade(evaluator, client, instance, instance.patch,
                             test_cmd=f"python3 -m pytest -rA -p no:cacheprovider {WORDS} -k 'not sentence'")
    assert evaluation.details["test_command"].endswith("-k 'not sentence'")
    assert evaluation.details["tests"][f"{WORDS}::test_sentence"] == "missing"
    assert evaluation.reward == 0.0 and evaluation.details["pass_to_pass_failing"] == [f"{WORDS}::test_sentence"]


async def test_what_is_not_the_policys_fault_is_an_error(images: dict[str, SwebenchInstance],
                                                         evaluator: SwebenchEvaluator, client: Any,
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    instance = images["rollwire__textstats-1"]
    assert instance.test_patch
    broken = instance.test_patch.replace(' def test_line_count():', ' def test_lines():')
    evaluation = await grade(evaluator, client, instance, instance.patch, test_patch=broken)
    assert evaluation.status == "error" and evaluation.reward is None
    assert evaluation.error is not None and "test_patch does not apply" in evaluation.error
    assert evaluation.details["patch_applied_by"] == "git apply"

    evaluation = await grade(evaluator, client, instance, instance.patch, image="rollwire/swe-no-such-image:latest")
    assert evaluation.status == "error" and "rollwire/swe-no-such-image:latest" in (evaluation.error or "")

    evaluation = await grade(evaluator, client, instance, instance.patch, FAIL_TO_PASS=[], PASS_TO_PASS=[])
    assert evaluation.status == "error" and "list no test" in (evaluation.error or "")

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    evaluation = await grade(SwebenchEvaluator(scratch=tmp_path / "scratch2"), client, instance, instance.patch)
    assert evaluation.status == "error" and "no Docker engine answers" in (evaluation.error or "")


async def test_a_cancelled_grading_leaves_no_container(images: dict[str, SwebenchInstance],
                                                       evaluator: SwebenchEvaluator, client: Any) -> None:
    instance = images["rollwire__textstats-1"]
    request = to_task_request(instance, harness="qwen-code")
    assert request.evaluator is not None
    session_id = f"cancel-{uuid.uuid4().hex[:8]}"
    spec = SessionSpec(session_id=session_id, runtime=request.runtime, evaluator=request.evaluator.model_copy(
        update={"settings": {**request.evaluator.settings, "test_cmd": "sleep 60"}}))
    ended = SessionEnded(session_id=session_id, status=SessionStatus.COMPLETED, patch=instance.patch)
    label = {"label": f"{SESSION_LABEL}=swebench-eval-{session_id}"}
    grading = asyncio.ensure_future(evaluator.evaluate(ended, spec))
    deadline = time.monotonic() + 60

    def tests_running() -> bool:
        for container in client.containers.list(ignore_removed=True, filters=label):
            try:  # a container may stop between the list and its process table
                rows = container.top().get("Processes") or []
            except docker.errors.APIError:
                continue
            if any("sleep 60" in " ".join(row) for row in rows):
                return True
        return False

    while not tests_running():
        assert time.monotonic() < deadline and not grading.done(), "the tests never started"
        await asyncio.sleep(0.2)
    grading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await grading
    await asyncio.sleep(0)  # the shielded teardown may finish just after the cancellation
    deadline = time.monotonic() + 10
    while client.containers.list(all=True, ignore_removed=True, filters=label):
        assert time.monotonic() < deadline, "the cancelled grading's container is left"
        await asyncio.sleep(0.2)
