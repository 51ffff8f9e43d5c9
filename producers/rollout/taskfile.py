"""Reading a tasks file (JSON Lines, one TaskRequest a line) and posting it to a rollout server.

Blank lines and lines starting with ``#`` are skipped. A relative ``runtime.repo`` that is a local path
(not a URL, not ``user@host:path``) is resolved against the tasks file's directory, so a tasks file and
its task repositories travel together. A bad line is reported with its line number; the others are
still submitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from schemas.rollouts import TaskSubmitted
from schemas.tasks import TaskRequest


@dataclass(frozen=True, slots=True)
class TaskLine:
    """One good line of a tasks file."""

    line_no: int
    request: TaskRequest


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that could not be read or was refused, and why."""

    line_no: int
    error: str


@dataclass(frozen=True, slots=True)
class Overrides:
    """What the command line overrides in every task of the file."""

    harness: str | None = None
    samples: int | None = None
    task_id_suffix: str | None = None
    """Appended to every task id (``{task_id}-{suffix}``) so that a file can be run more than once."""


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


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error["loc"]) or "(line)"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def load_tasks(path: Path, overrides: Overrides = Overrides()) -> tuple[list[TaskLine], list[BadLine]]:
    """The file's task requests and its bad lines, each with its line number (1-based)."""
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
            bad.append(BadLine(line_no, _describe(exc)))
            continue
        good.append(TaskLine(line_no, request))
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


def submit_file(path: Path, server_url: str, overrides: Overrides = Overrides(), *,
                timeout_s: float = 30.0) -> tuple[list[tuple[int, TaskSubmitted]], list[BadLine]]:
    """Submit every good line of a tasks file; the submitted tasks and the bad or refused lines."""
    good, bad = load_tasks(path, overrides)
    submitted: list[tuple[int, TaskSubmitted]] = []
    with httpx.Client(timeout=timeout_s) as client:
        for line in good:
            try:
                submitted.append((line.line_no, post_task(client, server_url, line.request)))
            except ValueError as exc:
                bad.append(BadLine(line.line_no, str(exc)))
            except httpx.HTTPError as exc:
                bad.append(BadLine(line.line_no, f"rollout server at {server_url} unreachable: {exc}"))
    bad.sort(key=lambda b: b.line_no)
    return submitted, bad
