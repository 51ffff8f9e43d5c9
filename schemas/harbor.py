"""Harbor-format tasks: a folder per task, read into the TaskRequest of one GRPO group.

A Harbor task directory (the layout of laude-institute/harbor and Terminal-Bench 2) holds:

* ``task.toml`` — ``version``, ``[metadata]`` (free-form), ``[verifier] timeout_sec`` and ``env``,
  ``[agent] timeout_sec``, ``[environment] build_timeout_sec``, ``docker_image``, ``cpus``, ``memory_mb``
  (or ``memory``, docker notation); unknown keys are ignored. rollwire reads one table of its own,
  ``[judge]`` (``rubric`` or ``rubric_file``, ``coefficient``, ``scale``): a task with a rubric is scored
  by the ``judge`` evaluator around the ``harbor`` one (processors/evaluators/judge.py).
* ``instruction.md`` — the harness's instruction.
* ``environment/Dockerfile`` — the environment, built on the local engine (nothing is pulled; the image
  is named by a digest of the folder, so a changed environment is a new image); or, without a
  Dockerfile, ``[environment] docker_image``, which must already be on the engine.
* ``tests/test.sh`` — the verifier, run by ``bash /tests/test.sh`` in a fresh container of the image
  with the session's changes applied; it writes the reward to ``/logs/verifier/reward.txt`` (a number)
  or ``/logs/verifier/reward.json`` (``{"reward": 1.0, ...}``).
* ``solution/solve.sh`` — the oracle: ``--oracle`` runs it in place of a harness.

The session's changes are the git diff of the image's WORKDIR (the image build commits it:
producers/runtimes/image_build.py), so a task's state must live under its WORKDIR (Harbor's ``/app``)
for the verifier's fresh container to see it. The task folder is read on this machine: ``tests/`` and
``solution/`` are mounted into containers from their absolute paths.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from schemas.envelope import Model
from schemas.tasks import AgentSpec, EngineParams, EvaluatorSpec, HarnessName, ImageBuild, RuntimeSpec, TaskRequest

EVALUATOR_NAME = "harbor"
JUDGE_EVALUATOR_NAME = "judge"
TESTS_MOUNT = "/rollwire/task/tests"
SOLUTION_MOUNT = "/rollwire/task/solution"
VERIFIER_TESTS = "/tests"
VERIFIER_LOGS = "/logs/verifier"
ORACLE_COMMAND = (f"bash -c 'rm -rf /solution && mkdir -p /solution && cp -a {SOLUTION_MOUNT}/. /solution/ "
                  "&& bash /solution/solve.sh'")
"""The oracle's command line (the ``command`` harness): solve.sh from a writable copy at /solution, as Harbor
runs it, in the session's workspace."""
DEFAULT_BUILD_TIMEOUT_S = 600.0
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
_SLUG_UNSAFE = re.compile(r"[^a-z0-9_.-]")
_NOT_CONTEXT = ("__pycache__", ".pytest_cache")


class _Table(Model):
    model_config = ConfigDict(extra="ignore")


class VerifierTable(_Table):
    timeout_sec: float = Field(default=DEFAULT_VERIFIER_TIMEOUT_S, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class AgentTable(_Table):
    timeout_sec: float = Field(default=DEFAULT_AGENT_TIMEOUT_S, gt=0)


class EnvironmentTable(_Table):
    build_timeout_sec: float = Field(default=DEFAULT_BUILD_TIMEOUT_S, gt=0)
    docker_image: str | None = None
    cpus: float | None = Field(default=None, gt=0)
    memory_mb: int | None = Field(default=None, ge=6)
    memory: str | None = None


class JudgeTable(_Table):
    """rollwire's own table: the rubric an LLM judge scores the session by, and how the score counts."""

    rubric: str | None = None
    rubric_file: str | None = Field(default=None, description="A file of the task folder holding the rubric.")
    coefficient: float = Field(default=1.0, description="reward = outcome + coefficient x score / scale.")
    scale: float = Field(default=10.0, gt=0, description="The judge scores from 0 to this.")


class TaskToml(_Table):
    """``task.toml`` (unknown keys ignored)."""

    version: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierTable = Field(default_factory=VerifierTable)
    agent: AgentTable = Field(default_factory=AgentTable)
    environment: EnvironmentTable = Field(default_factory=EnvironmentTable)
    judge: JudgeTable | None = None


class HarborTaskError(ValueError):
    """A task folder that cannot be read as a Harbor task; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class HarborTask:
    """One task folder, read."""

    name: str
    path: Path
    config: TaskToml
    instruction: str
    image: str
    build: ImageBuild | None
    rubric: str | None

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"


def _folder_digest(folder: Path) -> str:
    """A digest of a folder's files (paths, modes, contents): the environment image's tag."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_CONTEXT)
        for name in sorted(files):
            path = Path(root, name)
            digest.update(str(path.relative_to(folder)).encode() + b"\0")
            digest.update(str(path.stat().st_mode & 0o111).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def image_name(name: str, environment: Path) -> str:
    """The environment image of a task: ``rollwire/harbor-<task>:<digest of environment/>``."""
    return f"rollwire/harbor-{_SLUG_UNSAFE.sub('-', name.lower())}:{_folder_digest(environment)[:16]}"


def read_task(path: Path) -> HarborTask:
    """Read one task folder; :class:`HarborTaskError` names what is missing or malformed."""
    path = path.resolve()
    try:
        config = TaskToml.model_validate(tomllib.loads((path / "task.toml").read_text(encoding="utf-8")))
        instruction = (path / "instruction.md").read_text(encoding="utf-8").strip()
    except FileNotFoundError as exc:
        raise HarborTaskError(f"{path.name}: {Path(exc.filename or '').name} is missing") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{path.name}: task.toml: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise HarborTaskError(f"{path.name}: task.toml: {problems}") from None
    if not instruction:
        raise HarborTaskError(f"{path.name}: instruction.md is empty")
    if not (path / "tests" / "test.sh").is_file():
        raise HarborTaskError(f"{path.name}: tests/test.sh is missing")
    environment = path / "environment"
    build: ImageBuild | None = None
    if (environment / "Dockerfile").is_file():
        image = image_name(path.name, environment)
        build = ImageBuild(context=str(environment), timeout_s=config.environment.build_timeout_sec)
    elif config.environment.docker_image:
        image = config.environment.docker_image
    else:
        raise HarborTaskError(f"{path.name}: neither environment/Dockerfile nor [environment] docker_image")
    rubric: str | None = None
    if config.judge is not None:
        if config.judge.rubric_file:
            try:
                rubric = (path / config.judge.rubric_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise HarborTaskError(f"{path.name}: [judge] rubric_file: {exc}") from None
        else:
            rubric = (config.judge.rubric or "").strip()
        if not rubric:
            raise HarborTaskError(f"{path.name}: [judge] has no rubric (rubric or rubric_file)")
    return HarborTask(path.name, path, config, instruction, image, build, rubric)


def read_tasks(folder: Path) -> tuple[list[HarborTask], list[tuple[str, str]]]:
    """Every task under ``folder`` (a folder of task folders, or one task folder) and the bad ones (name,
    reason), in name order."""
    folder = folder.resolve()
    candidates = [folder] if (folder / "task.toml").is_file() else sorted(
        p for p in folder.iterdir() if p.is_dir() and (p / "task.toml").is_file())
    good: list[HarborTask] = []
    bad: list[tuple[str, str]] = []
    for candidate in candidates:
        try:
            good.append(read_task(candidate))
        except HarborTaskError as exc:
            bad.append((candidate.name, str(exc)))
    if not candidates:
        bad.append((folder.name, "no task folder (one with a task.toml) here"))
    return good, bad


def verifier_settings(task: HarborTask) -> dict[str, Any]:
    """The ``harbor`` evaluator's settings for this task."""
    return {"image": task.image, "tests_dir": str(task.tests_dir), "timeout_s": task.config.verifier.timeout_sec,
            "env": dict(task.config.verifier.env)}


def evaluator_spec(task: HarborTask, *, judged: bool = True) -> EvaluatorSpec:
    """``harbor``, or ``judge`` around it when the task has a rubric (and ``judged``)."""
    outcome = EvaluatorSpec(name=EVALUATOR_NAME, settings=verifier_settings(task))
    if not judged or task.rubric is None or task.config.judge is None:
        return outcome
    return EvaluatorSpec(name=JUDGE_EVALUATOR_NAME, settings={
        "outcome": outcome.model_dump(mode="json"), "rubric": task.rubric,
        "coefficient": task.config.judge.coefficient, "scale": task.config.judge.scale})


def _memory(environment: EnvironmentTable) -> str | None:
    if environment.memory:
        return environment.memory.strip().lower().removesuffix("b")
    return f"{environment.memory_mb}m" if environment.memory_mb else None


def to_task_request(task: HarborTask, *, harness: HarnessName, samples: int = 1, oracle: bool = False,
                    command: str | None = None, model: str | None = None, engine: EngineParams | None = None,
                    task_id_suffix: str | None = None, runtime: dict[str, Any] | None = None) -> TaskRequest:
    """The TaskRequest of one task: ``samples`` sessions in its environment image, scored by ``harbor``.

    ``oracle`` runs ``solution/solve.sh`` (the ``command`` harness, no model call) in place of ``harness``,
    scored by the verifier alone: an oracle run checks the task set, and a judge's opinion of a script's
    work says nothing about it.
    The session's budget is the agent's timeout plus the image build's (the first session of a task whose
    image is not built yet builds it in its init)."""
    mounts = [f"{task.solution_dir}:{SOLUTION_MOUNT}:ro"] if oracle else []
    if oracle and not (task.solution_dir / "solve.sh").is_file():
        raise HarborTaskError(f"{task.name}: --oracle needs solution/solve.sh")
    agent: dict[str, Any] = {"harness": "command" if oracle else harness,
                             "command": ORACLE_COMMAND if oracle else command}
    if model is not None:
        agent["model"] = model
    spec = {**(runtime or {}), "kind": "docker", "image": task.image, "build": task.build, "repo": None,
            "mounts": [*(runtime or {}).get("mounts", []), *mounts]}
    if task.config.environment.cpus is not None:
        spec.setdefault("cpus", task.config.environment.cpus)
    if _memory(task.config.environment) is not None:
        spec.setdefault("memory", _memory(task.config.environment))
    build_s = task.config.environment.build_timeout_sec if task.build is not None else 0.0
    request: dict[str, Any] = {
        "task_id": f"{task.name}-{task_id_suffix}" if task_id_suffix else task.name,
        "instruction": task.instruction,
        "num_samples": samples,
        "timeout_s": task.config.agent.timeout_sec + build_s,
        "runtime": RuntimeSpec(**spec),
        "agent": AgentSpec.model_validate(agent),
        "evaluator": evaluator_spec(task, judged=not oracle),
        "metadata": {"harbor": {"task": task.name, "path": str(task.path), "oracle": oracle}},
    }
    if engine is not None:
        request["engine"] = engine
    return TaskRequest.model_validate(request)
