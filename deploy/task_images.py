"""The environment images a run's tasks build from their own Dockerfiles (Harbor tasks), built before the
sessions start.

The docker runtime would build each one in its first session's init (producers/runtimes/image_build.py),
inside that session's budget; the main job builds them here first, with their progress in its output, so
that no session spends its budget on a build. A build that fails is reported and left to the sessions:
each then fails its init with the same reason (an infrastructure failure, resubmitted, failing again),
which is what the run's summary and the task's status show.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deploy.docker_engine import client_for, ensure_engine
from producers.runtimes.base import RuntimeInitError
from producers.runtimes.image_build import ImageBuilds
from schemas.tasks import ImageBuild, TaskRequest

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class TaskImage:
    """One task image: built now, found on the engine, or failed (with the builder's reason)."""

    image: str
    status: str
    seconds: float
    error: str | None = None


def task_builds(requests: Sequence[TaskRequest]) -> dict[str, ImageBuild]:
    """The images ``requests`` build themselves (image name -> how), each once."""
    builds: dict[str, ImageBuild] = {}
    for request in requests:
        runtime = request.runtime
        if runtime.kind == "docker" and runtime.image and runtime.build is not None:
            builds.setdefault(runtime.image, runtime.build)
    return builds


def build_task_images(requests: Sequence[TaskRequest], say: Say = print) -> list[TaskImage]:
    """Build every image ``requests`` name a build for and the engine lacks; one row per image."""
    builds = task_builds(requests)
    if not builds:
        return []
    client = client_for(ensure_engine(), timeout_s=max(b.timeout_s for b in builds.values()) + 60)
    builder = ImageBuilds()
    rows = []
    for image, build in builds.items():
        started = time.monotonic()
        try:
            built = builder.ensure(client, image, build)
        except RuntimeInitError as exc:
            rows.append(TaskImage(image, "failed", time.monotonic() - started, str(exc)))
            say(f"{image}: FAILED, its sessions will fail in init: {str(exc).splitlines()[0]}")
            continue
        rows.append(TaskImage(image, "built" if built else "up to date", time.monotonic() - started))
        say(f"{image}: {rows[-1].status}" + (f" in {rows[-1].seconds:.1f} s" if built else ""))
    return rows
