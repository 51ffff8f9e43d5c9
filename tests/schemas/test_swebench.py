"""SWE-bench-style instances: the instance model, reading a file, the TaskRequest, `submit --format`.

FAIL_TO_PASS/PASS_TO_PASS must read the same from SWE-bench's JSON-encoded strings and from lists; the
image must default to SWE-bench's own name and take any of its three spellings; a bad instance must be
reported where it is while the others convert; an instance must become a task whose session works in the
image's /testbed and whose `swebench` evaluator gets the tests; the shipped examples must be committed
deterministically (their base_commit is what any machine computes); and `rollwire submit --format
swebench` must put those tasks on the real broker.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from processors.evaluators.swebench import plan_from
from producers.rollout import cli as rollout_cli
from producers.rollout.taskfile import Overrides, load_tasks
from schemas.sessions import SessionSpec
from schemas.swebench import (
    SwebenchInstance,
    local_image_name,
    parse_instances,
    read_instances,
    swebench_image_name,
    to_task_request,
)
from schemas.tasks import EngineParams, TaskRequest
from schemas.topics import Topic
from schemas.transport import KafkaSettings
from tests.producers.rollout_helpers import read_topic, rollout_server

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "swebench"
F2P = ["tests/test_x.py::test_new", "tests/test_x.py::TestC::test_param[a-b]"]
P2P = ["tests/test_x.py::test_old"]


def instance(**fields: Any) -> dict[str, Any]:
    """An instance as SWE-bench's files hold it (test lists JSON-encoded), with ``fields`` over it."""
    return {"instance_id": "astropy__astropy-12907", "repo": "astropy/astropy",
            "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
            "problem_statement": "Modeling's separability_matrix does not compute separability correctly",
            "patch": "diff --git a/x b/x\n", "test_patch": "diff --git a/tests/test_x.py b/tests/test_x.py\n",
            "FAIL_TO_PASS": json.dumps(F2P), "PASS_TO_PASS": json.dumps(P2P), "hints_text": "",
            "version": "4.3", "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
            "created_at": "2022-03-03T15:14:54Z", **fields}


def test_test_lists_read_the_same_as_json_strings_or_lists() -> None:
    from_strings = SwebenchInstance.model_validate(instance())
    from_lists = SwebenchInstance.model_validate(instance(FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P))
    assert from_strings.fail_to_pass == from_lists.fail_to_pass == F2P
    assert from_strings.pass_to_pass == from_lists.pass_to_pass == P2P
    assert SwebenchInstance.model_validate(instance(PASS_TO_PASS="[]")).pass_to_pass == []
    for bad in ("tests/test_x.py::test_new", "[1, 2]", "{}", []):
        with pytest.raises(ValueError, match="FAIL_TO_PASS"):
            SwebenchInstance.model_validate(instance(FAIL_TO_PASS=bad))


def test_image_defaults_to_swebench_naming_and_takes_each_spelling() -> None:
    assert SwebenchInstance.model_validate(instance()).image == "sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert swebench_image_name("Django__Django-11099") == "sweb.eval.x86_64.django_1776_django-11099:latest"
    for key in ("image_name", "docker_image", "environment_image"):
        assert SwebenchInstance.model_validate(instance(**{key: "my/env:1"})).image == "my/env:1"
    assert local_image_name("Owner__Repo/X-1") == "rollwire/swe-owner__repo-x-1:latest"


def test_unknown_columns_are_ignored_and_numbers_become_text() -> None:
    parsed = SwebenchInstance.model_validate(instance(difficulty="<15 min fix", version=3.0,
                                                      test_cmd=["pytest", "-x y"]))
    assert parsed.version == "3.0"
    assert parsed.test_cmd == "pytest '-x y'"


def test_a_bad_instance_is_reported_where_it_is_and_the_others_convert() -> None:
    lines = [json.dumps(instance(instance_id="a__b-1")), "{not json", "",
             "# a comment", json.dumps(instance(instance_id="a__b-2", problem_statement=None)),
             json.dumps(instance(instance_id="a__b-3", FAIL_TO_PASS="not a list")), json.dumps([1]),
             json.dumps(instance(instance_id="a__b-4"))]
    good, bad = parse_instances("\n".join(lines))
    assert [(g.where, g.instance.instance_id) for g in good] == [("line 1", "a__b-1"), ("line 8", "a__b-4")]
    assert [(b.where, b.error.split(":")[0]) for b in bad] == [
        ("line 2", "not JSON"), ("line 5", "problem_statement"), ("line 6", "FAIL_TO_PASS"),
        ("line 7", "a JSON list, not an object")]

    array = json.dumps([instance(instance_id="a__b-1"), instance(instance_id="a__b-2", base_commit=""),
                        instance(instance_id="a__b-3")], indent=2)
    good, bad = parse_instances(array)
    assert [(g.position, g.where) for g in good] == [(1, "instance 1"), (3, "instance 3")]
    assert [(b.position, b.where) for b in bad] == [(2, "instance 2")] and "base_commit" in bad[0].error
    _, bad = parse_instances(array[:-5])
    assert len(bad) == 1 and bad[0].error.startswith("not a JSON array")
    single, bad = parse_instances(json.dumps(instance(), indent=2))  # one pretty-printed object
    assert not bad and single[0].instance.instance_id == "astropy__astropy-12907"


def test_an_instance_becomes_a_task_for_the_swebench_evaluator() -> None:
    parsed = SwebenchInstance.model_validate(instance(test_cmd="pytest -rA tests/test_x.py"))
    request = to_task_request(parsed, harness="pi", samples=4, engine=EngineParams(max_tokens=64),
                              runtime={"network": "host", "memory": "2g"}, eval_timeout_s=60)
    assert request.task_id == "astropy__astropy-12907" and request.num_samples == 4
    assert request.instruction.startswith(parsed.problem_statement) and "/testbed" in request.instruction
    assert request.agent.harness == "pi" and request.engine.max_tokens == 64
    runtime = request.runtime
    assert (runtime.kind, runtime.image, runtime.workdir, runtime.base_commit, runtime.repo) == (
        "docker", parsed.image, "/testbed", parsed.base_commit, None)
    assert (runtime.network, runtime.memory) == ("host", "2g")
    assert request.evaluator is not None and request.evaluator.name == "swebench"
    assert request.evaluator.settings == {"test_patch": parsed.test_patch, "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P,
                                          "image": parsed.image, "workdir": "/testbed", "timeout_s": 60,
                                          "test_cmd": "pytest -rA tests/test_x.py"}
    assert request.metadata == {"swebench": {"instance_id": "astropy__astropy-12907", "repo": "astropy/astropy"}}
    # What the rollout server receives reads back the same, and the evaluator's plan is this instance's.
    again = TaskRequest.model_validate_json(request.model_dump_json(exclude_none=True))
    assert again == request
    spec = SessionSpec(session_id="s", runtime=again.runtime, evaluator=again.evaluator)
    plan = plan_from(spec.evaluator.settings if spec.evaluator else {}, spec)
    assert (plan.fail_to_pass, plan.pass_to_pass, plan.image, plan.workdir, plan.base_commit, plan.timeout_s) == (
        F2P, P2P, parsed.image, "/testbed", parsed.base_commit, 60.0)
    assert to_task_request(parsed, harness="qwen-code", task_id_suffix="r7").task_id == "astropy__astropy-12907-r7"


def test_the_examples_load_as_tasks_with_their_local_images() -> None:
    good, bad = load_tasks(EXAMPLES / "instances.jsonl", Overrides(samples=2, task_id_suffix="x"), format="swebench")
    assert not bad
    assert [line.request.task_id for line in good] == [
        "rollwire__textstats-1-x", "rollwire__intervals-2-x", "rollwire__slugify-3-x"]
    for line in good:
        request = line.request
        instance_id = request.metadata["swebench"]["instance_id"]
        assert request.runtime.image == local_image_name(instance_id) == f"rollwire/swe-{instance_id}:latest"
        assert request.num_samples == 2 and request.agent.harness == "qwen-code"
        assert (EXAMPLES / "repos" / instance_id).is_dir()
    # A harness the rollout would refuse is reported on every entry, not raised.
    good, bad = load_tasks(EXAMPLES / "instances.jsonl", Overrides(harness="notepad"), format="swebench")
    assert not good and [b.label for b in bad] == ["line 1", "line 2", "line 3"] and "notepad" in bad[0].error


def test_example_base_commits_are_the_deterministic_commit_of_their_sources(tmp_path: Path) -> None:
    from deploy.images import commit_repository

    records, bad = read_instances(EXAMPLES / "instances.jsonl")
    assert not bad and len(records) == 3
    for record in records:
        instance_id = record.instance.instance_id
        commit = commit_repository(EXAMPLES / "repos" / instance_id, tmp_path / instance_id)
        assert commit == record.instance.base_commit == record.instance.environment_setup_commit


@pytest.mark.kafka
async def test_submit_format_swebench_puts_the_instances_on_the_broker(kafka: KafkaSettings, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:6]
    lines = [json.dumps(instance(instance_id=f"a__b-{run}", FAIL_TO_PASS=F2P)), "{not json",
             json.dumps(instance(instance_id=f"c__d-{run}", docker_image="env/c:1"))]
    tasks_file = tmp_path / "instances.jsonl"
    tasks_file.write_text("\n".join(lines) + "\n")
    app = typer.Typer()
    app.command()(rollout_cli.submit)
    with rollout_server(kafka, tmp_path / "state") as url:
        result = CliRunner().invoke(app, [str(tasks_file), "--server", url, "--format", "swebench", "--samples", "2",
                                          "--harness", "pi", "--max-tokens", "32", "--network", "host"])
        refused = CliRunner().invoke(app, [str(tasks_file), "--server", url, "--format", "swe"])
    assert refused.exit_code == 2 and "--format must be one of tasks, swebench" in refused.stderr
    assert result.exit_code == 1, result.output
    assert f"line 1: task a__b-{run}: a__b-{run}-s0 a__b-{run}-s1" in result.stdout
    assert f"line 3: task c__d-{run}: c__d-{run}-s0 c__d-{run}-s1" in result.stdout
    assert "line 2: error: not JSON" in result.stderr
    specs = {s.session_id: s for s in await read_topic(kafka, Topic.SESSIONS, 4)}
    assert len(specs) == 4
    spec = specs[f"c__d-{run}-s1"]
    assert (spec.runtime.kind, spec.runtime.image, spec.runtime.workdir, spec.runtime.network) == (
        "docker", "env/c:1", "/testbed", "host")
    assert spec.agent is not None and spec.agent.harness == "pi" and spec.engine.max_tokens == 32
    assert spec.evaluator is not None and spec.evaluator.name == "swebench"
    assert spec.evaluator.settings["FAIL_TO_PASS"] == F2P and spec.evaluator.settings["image"] == "env/c:1"
