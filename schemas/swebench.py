"""SWE-bench-style task instances: the instance model, reading an instances file, the TaskRequest it makes.

An instance has the SWE-bench / SWE-Gym JSON shape (``instance_id``, ``repo``, ``base_commit``,
``problem_statement``, gold ``patch``, ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ...); fields
this model does not know (a data set's own extra columns) are ignored. ``FAIL_TO_PASS`` and
``PASS_TO_PASS`` are JSON-encoded strings in SWE-bench's files and lists elsewhere: both are accepted.
The environment image is ``image_name`` (or ``docker_image`` / ``environment_image``), by default
SWE-bench's own name for the instance (:func:`swebench_image_name`); the repository is at ``/testbed``
inside it, at ``base_commit``.

:func:`read_instances` reads a JSON array or JSON Lines; a bad instance is reported with where it is and
the others still convert. :func:`to_task_request` turns an instance into the TaskRequest of one GRPO
group: the harness works on the image's own ``/testbed`` (no network but the proxy), and the ``swebench``
evaluator (processors/evaluators/swebench.py) grades each session's patch in a fresh container of the
same image.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.envelope import Model
from schemas.tasks import AgentSpec, EngineParams, EvaluatorSpec, HarnessName, RuntimeSpec, TaskRequest

TESTBED = "/testbed"
EVALUATOR_NAME = "swebench"
_SLUG_UNSAFE = re.compile(r"[^a-z0-9_.-]")


def swebench_image_name(instance_id: str) -> str:
    """SWE-bench's environment image for an instance: ``sweb.eval.x86_64.<id>:latest`` ("__" → "_1776_")."""
    return f"sweb.eval.x86_64.{instance_id.replace('__', '_1776_')}:latest".lower()


def local_image_name(instance_id: str) -> str:
    """The image ``rollwire images build`` makes for a local instance: ``rollwire/swe-<slug>:latest``."""
    return f"rollwire/swe-{_SLUG_UNSAFE.sub('-', instance_id.lower())}:latest"


def parse_test_ids(value: Any) -> list[str]:
    """A FAIL_TO_PASS / PASS_TO_PASS value as a list of test ids: a list, or a JSON-encoded list."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a string here must be a JSON-encoded list of test ids: {exc.msg}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError("expected a list of non-empty test id strings (or such a list JSON-encoded)")
    return list(value)


class SwebenchInstance(Model):
    """One task instance in the SWE-bench / SWE-Gym shape (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    instance_id: str = Field(min_length=1, max_length=128)
    repo: str = Field(min_length=1, description="The upstream repository, 'owner/name'.")
    base_commit: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    patch: str | None = Field(default=None, description="The gold patch (reference solution).")
    test_patch: str = Field(default="", description="Applied before grading: the tests the harness never saw.")
    fail_to_pass: list[str] = Field(alias="FAIL_TO_PASS", min_length=1)
    pass_to_pass: list[str] = Field(default_factory=list, alias="PASS_TO_PASS")
    hints_text: str | None = None
    version: str | None = None
    environment_setup_commit: str | None = None
    created_at: str | None = None
    image_name: str | None = Field(default=None, validation_alias=AliasChoices(
        "image_name", "docker_image", "environment_image"))
    test_cmd: str | None = Field(default=None, description=(
        "Shell command that runs the tests in /testbed (pytest -rA output expected); default: pytest on "
        "the files the listed test ids name."))

    @field_validator("fail_to_pass", "pass_to_pass", mode="before")
    @classmethod
    def _test_ids(cls, value: Any) -> list[str]:
        return parse_test_ids(value)

    @field_validator("version", "created_at", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> Any:
        return value if value is None or isinstance(value, str) else str(value)

    @field_validator("test_cmd", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, list) and all(isinstance(part, str) for part in value):
            return shlex.join(value)
        return value

    @model_validator(mode="after")
    def _default_image(self) -> SwebenchInstance:
        if not self.image_name:
            self.image_name = swebench_image_name(self.instance_id)
        return self

    @property
    def image(self) -> str:
        """The environment image (never empty after validation)."""
        assert self.image_name is not None
        return self.image_name


def instruction_for(instance: SwebenchInstance) -> str:
    """The harness's instruction: the problem statement and where the repository is."""
    return (f"{instance.problem_statement.rstrip()}\n\n"
            f"The repository ({instance.repo}) is your working directory ({TESTBED}): edit its files there "
            "to resolve the issue above.")


def evaluator_settings(instance: SwebenchInstance, *, timeout_s: float | None = None) -> dict[str, Any]:
    """The ``swebench`` evaluator's settings for this instance."""
    settings: dict[str, Any] = {"test_patch": instance.test_patch, "FAIL_TO_PASS": list(instance.fail_to_pass),
                                "PASS_TO_PASS": list(instance.pass_to_pass), "image": instance.image,
                                "workdir": TESTBED}
    if instance.test_cmd:
        settings["test_cmd"] = instance.test_cmd
    if timeout_s is not None:
        settings["timeout_s"] = timeout_s
    return settings


def to_task_request(instance: SwebenchInstance, *, harness: HarnessName, samples: int = 1,
                    model: str | None = None, command: str | None = None, timeout_s: float | None = None,
                    eval_timeout_s: float | None = None, engine: EngineParams | None = None,
                    task_id_suffix: str | None = None, runtime: dict[str, Any] | None = None) -> TaskRequest:
    """The TaskRequest for one instance: ``samples`` sessions of ``harness`` in the instance's image.

    ``runtime`` holds extra RuntimeSpec fields (``network``, ``cpus``, ``memory``, ...) for the sessions'
    containers; the image, ``/testbed`` and the base commit always come from the instance."""
    agent: dict[str, Any] = {"harness": harness}
    if model is not None:
        agent["model"] = model
    if command is not None:
        agent["command"] = command
    task: dict[str, Any] = {
        "task_id": f"{instance.instance_id}-{task_id_suffix}" if task_id_suffix else instance.instance_id,
        "instruction": instruction_for(instance),
        "num_samples": samples,
        "runtime": RuntimeSpec(**{**(runtime or {}), "kind": "docker", "image": instance.image,
                                  "workdir": TESTBED, "base_commit": instance.base_commit, "repo": None}),
        "agent": AgentSpec.model_validate(agent),
        "evaluator": EvaluatorSpec(name=EVALUATOR_NAME,
                                   settings=evaluator_settings(instance, timeout_s=eval_timeout_s)),
        "metadata": {"swebench": {"instance_id": instance.instance_id, "repo": instance.repo}},
    }
    if timeout_s is not None:
        task["timeout_s"] = timeout_s
    if engine is not None:
        task["engine"] = engine
    return TaskRequest.model_validate(task)


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One good instance of a file: its 1-based position (line number for JSON Lines) and where to say it is."""

    position: int
    where: str
    instance: SwebenchInstance


@dataclass(frozen=True, slots=True)
class BadInstance:
    """An entry of an instances file that could not be read, and why."""

    position: int
    where: str
    error: str


def describe_validation_error(exc: ValidationError) -> str:
    """Pydantic's errors, short: ``field: message; ...`` (at most five)."""
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error["loc"]) or "(entry)"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def _instance(document: Any, position: int, where: str) -> InstanceRecord | BadInstance:
    if not isinstance(document, dict):
        return BadInstance(position, where, f"a JSON {type(document).__name__}, not an object")
    try:
        return InstanceRecord(position, where, SwebenchInstance.model_validate(document))
    except ValidationError as exc:
        return BadInstance(position, where, describe_validation_error(exc))


def parse_instances(text: str) -> tuple[list[InstanceRecord], list[BadInstance]]:
    """Instances from a JSON array, a single JSON object, or JSON Lines (blank and ``#`` lines skipped)."""
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as exc:
            if stripped.startswith("["):
                return [], [BadInstance(1, f"line {exc.lineno}", f"not a JSON array: {exc.msg} at column "
                                                                 f"{exc.colno}")]
        else:
            if isinstance(whole, list):
                return _split([_instance(item, i + 1, f"instance {i + 1}") for i, item in enumerate(whole)])
            return _split([_instance(whole, 1, "line 1")])
    results: list[InstanceRecord | BadInstance] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        try:
            document = json.loads(entry)
        except json.JSONDecodeError as exc:
            results.append(BadInstance(line_no, f"line {line_no}", f"not JSON: {exc.msg} at column {exc.colno}"))
            continue
        results.append(_instance(document, line_no, f"line {line_no}"))
    return _split(results)


def _split(results: list[InstanceRecord | BadInstance]) -> tuple[list[InstanceRecord], list[BadInstance]]:
    good = [r for r in results if isinstance(r, InstanceRecord)]
    bad = [r for r in results if isinstance(r, BadInstance)]
    return good, bad


def read_instances(path: Path) -> tuple[list[InstanceRecord], list[BadInstance]]:
    """The instances of a file (JSON array or JSON Lines) and its bad entries, each with where it is."""
    return parse_instances(path.read_text(encoding="utf-8"))
