"""The main job's build of the tasks' own environment images (deploy/task_images.py), on the real engine.

Every Harbor example's image must be built (or found) once, before any session; a task whose Dockerfile
builds on an image the engine lacks must be reported failed with the image's name, and the others built.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deploy.task_images import build_task_images, task_builds
from schemas.harbor import read_task, read_tasks, to_task_request

pytestmark = pytest.mark.docker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "harbor"


def test_the_examples_images_are_built_once_and_a_broken_one_is_reported(tmp_path: Path,
                                                                           docker_images: list[str]) -> None:
    tasks, bad = read_tasks(EXAMPLES)
    assert not bad
    broken_dir = tmp_path / "broken"
    shutil.copytree(EXAMPLES / "count-words", broken_dir)
    (broken_dir / "environment" / "Dockerfile").write_text("FROM debian:absent-here\nWORKDIR /app\n")
    requests = [to_task_request(task, harness="qwen-code", samples=2) for task in tasks]
    requests.append(to_task_request(read_task(broken_dir), harness="qwen-code"))
    assert len(task_builds(requests)) == 4  # the two samples of a task share one image
    said: list[str] = []
    rows = {row.image: row for row in build_task_images(requests, say=said.append)}
    for task in tasks:
        assert rows[task.image].status in ("built", "up to date"), rows[task.image]
    broken = rows[read_task(broken_dir).image]
    assert broken.status == "failed" and broken.error is not None
    assert "'debian:absent-here' is not on this Docker engine" in broken.error
    assert any("FAILED" in line and "debian:absent-here" in line for line in said)
    again = build_task_images(requests[:3], say=lambda _: None)
    assert [row.status for row in again] == ["up to date"] * 3
