"""Reading a tasks file and posting it to a rollout server.

Three formats (``load_tasks(..., format=...)``): ``tasks`` (the default: JSON Lines, one TaskRequest a
line), ``swebench`` (SWE-bench / SWE-Gym instances, a JSON array or JSON Lines, each converted by
schemas.swebench.to_task_request into a task graded by the ``swebench`` evaluator) and ``harbor`` (a
folder of Harbor task folders, each converted by schemas.harbor.to_task_request into a task in its
environment image, scored by the ``harbor`` evaluator; ``Overrides.oracle`` runs each task's
``solution/solve.sh`` in place of a harness).

Blank lines and lines starting with ``#`` are skipped. A relative ``runtime.repo`` that is a local path
(not a URL, not ``user@host:path``) is resolved against the tasks file's directory, so a tasks file and
its task repositories travel together. A bad line (or array entry) is reported with where it is; the
others are still submitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
from pydantic import ValidationError

from schemas import harbor
from schemas.rollouts import TaskSubmitted
from schemas.swebench import describe_validation_error, read_instances, to_task_request
from schemas.tasks import EngineParams, HarnessName, TaskRequest

TaskFormat = Literal["tasks", "swebench", "harbor"]
TASK_FORMATS: tuple[str, ...] = get_args(TaskFormat)
DEFAULT_SWEBENCH_HARNESS: HarnessName = "qwen-code"


@dataclass(frozen=True, slots=True)
class TaskLine:
    """One good line of a tasks file."""

    line_no: int
    request: TaskRequest
    where: str | None = None
    """Where it is when not a line (``instance 3`` of a JSON array); see :attr:`label`."""

    @property
    def label(self) -> str:
        """``line N``, or where the entry is."""
        return self.where or f"line {self.line_no}"


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that could not be read or was refused, and why."""

    line_no: int
    error: str
    where: str | None = None
    """Where it is when not a line (``instance 3`` of a JSON array); see :attr:`label`."""

    @property
    def label(self) -> str:
        """``line N``, or where the entry is."""
        return self.where or f"line {self.line_no}"


@dataclass(frozen=True, slots=True)
class Overrides:
    """What the command line overrides in every task of the file."""

    harness: str | None = None
    samples: int | None = None
    task_id_suffix: str | None = None
    """Appended to every task id (``{task_id}-{suffix}``) so that a file can be run more than once."""
    engine: EngineParams | None = None
    """Engine parameters for tasks that carry none (SWE-bench instances)."""
    runtime: dict[str, Any] | None = None
    """Extra RuntimeSpec fields for SWE-bench tasks' containers (``network``, ``cpus``, ``memory``, ...)."""
    oracle: bool = False
    """Harbor tasks: run each task's ``solution/solve.sh`` instead of a harness."""
    command: str | None = None
    """Harbor tasks with the ``command`` harness: its command line."""


def _is_local_path(repo: str) -> bool:
    if "://" in repo:
        return False
    head = repo.split("/", 1)[0]
    return not ("@" in head and ":" in head)  # git@host:owner/repo


def _resolve(document: dict[str, Any], base: Path, overrides: Overrides) -> dict[str, Any]:
    runtime = document.get("runtime")
    if isinstance(runtime, dict) and isinstance(runtime.get("repo"), str) and _is_local_path(runtime["repo"]):
        repo = Path(runtime["repo"]).expanduser()
        if not repo.is_absolute():
            runtime["repo"] = str((base / repo).resolve())
    if overrides.harness is not None:
        agent = document.setdefault("agent", {})
        if isinstance(agent, dict):
            agent["harness"] = overrides.harness
    if overrides.samples is not None:
        document["num_samples"] = overrides.samples
    if overrides.task_id_suffix and isinstance(document.get("task_id"), str):
        document["task_id"] = f"{document['task_id']}-{overrides.task_id_suffix}"
    return document


def load_tasks(path: Path, overrides: Overrides = Overrides(), *,
               format: TaskFormat = "tasks") -> tuple[list[TaskLine], list[BadLine]]:
    """The file's task requests and its bad entries, each with its line number (1-based; for a JSON
    array of SWE-bench instances, the entry's position)."""
    if format == "swebench":
        return load_swebench(path, overrides)
    if format == "harbor":
        return load_harbor(path, overrides)
    if format != "tasks":
        raise ValueError(f"unknown tasks file format {format!r}; known: {', '.join(TASK_FORMATS)}")
    good: list[TaskLine] = []
    bad: list[BadLine] = []
    base = path.resolve().parent
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            bad.append(BadLine(line_no, f"not JSON: {exc.msg} at column {exc.colno}"))
            continue
        if not isinstance(document, dict):
            bad.append(BadLine(line_no, f"a JSON {type(document).__name__}, not an object"))
            continue
        try:
            request = TaskRequest.model_validate(_resolve(document, base, overrides))
        except ValidationError as exc:
            bad.append(BadLine(line_no, describe_validation_error(exc)))
            continue
        good.append(TaskLine(line_no, request))
    return good, bad


def _harness(name: str | None) -> HarnessName:
    if name is None:
        return DEFAULT_SWEBENCH_HARNESS
    if name not in get_args(HarnessName):
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(get_args(HarnessName))}")
    return name  # type: ignore[return-value]  # checked against the literal's values above


def load_swebench(path: Path, overrides: Overrides = Overrides()) -> tuple[list[TaskLine], list[BadLine]]:
    """SWE-bench instances (JSON array or JSON Lines) as task requests; harness ``overrides.harness`` (default
    qwen-code), ``overrides.samples`` sessions each (default 1)."""
    records, refused = read_instances(path)
    bad = [BadLine(entry.position, entry.error, entry.where) for entry in refused]
    good: list[TaskLine] = []
    try:
        harness = _harness(overrides.harness)
    except ValueError as exc:
        return [], sorted(bad + [BadLine(r.position, str(exc), r.where) for r in records], key=lambda b: b.line_no)
    for record in records:
        try:
            request = to_task_request(record.instance, harness=harness, samples=overrides.samples or 1,
                                      engine=overrides.engine, task_id_suffix=overrides.task_id_suffix,
                                      runtime=overrides.runtime)
        except ValidationError as exc:
            bad.append(BadLine(record.position, describe_validation_error(exc), record.where))
            continue
        good.append(TaskLine(record.position, request, record.where))
    bad.sort(key=lambda b: b.line_no)
    return good, bad


def load_harbor(path: Path, overrides: Overrides = Overrides()) -> tuple[list[TaskLine], list[BadLine]]:
    """Harbor task folders under ``path`` as task requests (in name order; ``line_no`` is the position):
    harness ``overrides.harness`` (default qwen-code), or the oracle with ``overrides.oracle``."""
    if not path.is_dir():
        return [], [BadLine(1, f"{path} is not a folder (--format harbor reads a folder of task folders)")]
    tasks, refused = harbor.read_tasks(path)
    bad = [BadLine(0, reason, name) for name, reason in refused]
    good: list[TaskLine] = []
    try:
        harness = _harness(overrides.harness)
    except ValueError as exc:
        return [], bad + [BadLine(i, str(exc), t.name) for i, t in enumerate(tasks, start=1)]
    for position, task in enumerate(tasks, start=1):
        try:
            request = harbor.to_task_request(task, harness=harness, samples=overrides.samples or 1,
                                             oracle=overrides.oracle, command=overrides.command,
                                             engine=overrides.engine, task_id_suffix=overrides.task_id_suffix,
                                             runtime=overrides.runtime)
        except ValidationError as exc:
            bad.append(BadLine(position, describe_validation_error(exc), task.name))
            continue
        except harbor.HarborTaskError as exc:
            bad.append(BadLine(position, str(exc), task.name))
            continue
        good.append(TaskLine(position, request, task.name))
    return good, bad


def _refusal(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:300]}"
    if isinstance(detail, list):
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" for d in detail)
    return f"HTTP {response.status_code}: {detail}"


def post_task(client: httpx.Client, server_url: str, request: TaskRequest) -> TaskSubmitted:
    """POST one task; raises ValueError with the server's reason if it is refused."""
    response = client.post(f"{server_url.rstrip('/')}/v1/tasks",
                           json=request.model_dump(mode="json", exclude_none=True))
    if response.status_code != 202:
        raise ValueError(_refusal(response))
    return TaskSubmitted.model_validate(response.json())


def submit_file(path: Path, server_url: str, overrides: Overrides = Overrides(), *, timeout_s: float = 30.0,
                format: TaskFormat = "tasks") -> tuple[list[tuple[TaskLine, TaskSubmitted]], list[BadLine]]:
    """Submit every good entry of a tasks file; the submitted tasks and the bad or refused entries."""
    good, bad = load_tasks(path, overrides, format=format)
    submitted: list[tuple[TaskLine, TaskSubmitted]] = []
    with httpx.Client(timeout=timeout_s) as client:
        for line in good:
            try:
                submitted.append((line, post_task(client, server_url, line.request)))
            except ValueError as exc:
                bad.append(BadLine(line.line_no, str(exc), line.where))
            except httpx.HTTPError as exc:
                bad.append(BadLine(line.line_no, f"rollout server at {server_url} unreachable: {exc}", line.where))
    bad.sort(key=lambda b: b.line_no)
    return submitted, bad
