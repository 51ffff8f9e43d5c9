"""Building a task's environment image from its Dockerfile on the local engine, with nothing pulled.

A task that ships its environment as a Dockerfile (a Harbor task's ``environment/``) names the image by a
digest of that folder and says how to build it (:class:`~schemas.tasks.ImageBuild`); the docker runtime
builds it here when the engine does not have it yet, and every later session (and the evaluator's fresh
grading container) finds it. No registry is reachable, so before building, every base image the
Dockerfile's ``FROM`` lines name (not ``scratch``, not an earlier stage) must already be on the engine; a
missing one is refused with its name and how to provide it, instead of a pull that fails minutes later.

The Dockerfile gets one more instruction at its end when ``snapshot_workdir`` is set: the image's WORKDIR
committed as a git repository (a fixed identity and date, so the same files give the same commit on every
machine), unless it is one already. The docker runtime takes a session's changes as the diff of that
WORKDIR against its commit, and the evaluator applies them to a fresh container of the same image.

Builds use the host's network (as ``docker build --network host``: a Dockerfile may install packages from
the machine's Debian mirror) and the classic builder's API. One build per image at a time in a process
(:class:`ImageBuilds`); a second session of the same task waits for the first's build.
"""

from __future__ import annotations

import io
import re
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producers.runtimes.base import RuntimeInitError
from schemas.tasks import ImageBuild

OWN_BASE_IMAGES = ("rollwire/base:bookworm", "rollwire/harnesses:latest")
"""rollwire's own images (``rollwire images build``), which a task's Dockerfile may build on."""
GENERATED_DOCKERFILE = ".rollwire.Dockerfile"
SNAPSHOT_DATE = "2026-01-01T00:00:00+0000"
BUILD_LOG_TAIL = 3000

_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", re.IGNORECASE | re.MULTILINE)
# Run as the Dockerfile's last instruction, in its WORKDIR: commit it, unless it is a repository already.
_SNAPSHOT = (
    'RUN set -e; d="$(pwd)"; '
    'if [ "$d" = "/" ]; then echo "rollwire: the environment sets no WORKDIR (the session\'s changes are a git '
    'diff of it): add one, e.g. WORKDIR /app" >&2; exit 3; fi; '
    'command -v git >/dev/null || { echo "rollwire: git is not in the environment image (the session\'s changes '
    'are a git diff of its WORKDIR): install it, or build on rollwire/base:bookworm" >&2; exit 3; }; '
    'if ! git -C "$d" rev-parse --is-inside-work-tree >/dev/null 2>&1; then '
    'git init -q "$d" && git -C "$d" add -A && '
    'GIT_AUTHOR_NAME=rollwire GIT_AUTHOR_EMAIL=tasks@rollwire.invalid GIT_AUTHOR_DATE=' + SNAPSHOT_DATE + ' '
    'GIT_COMMITTER_NAME=rollwire GIT_COMMITTER_EMAIL=tasks@rollwire.invalid GIT_COMMITTER_DATE=' + SNAPSHOT_DATE + ' '
    'git -C "$d" -c commit.gpgsign=false commit -q --allow-empty -m environment; fi\n')


def base_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines build on, less ``scratch`` and earlier stages' names, in order."""
    stages: set[str] = set()
    bases: dict[str, None] = {}
    for match in _FROM.finditer(dockerfile):
        image, stage = match.group(1), match.group(2)
        if image.lower() != "scratch" and image.lower() not in stages:
            bases[image] = None
        if stage:
            stages.add(stage.lower())
    return list(bases)


def missing_base_message(image: str, dockerfile: Path) -> str:
    """Why a build cannot start: ``image`` is not on the engine; how to provide it."""
    return (f"{dockerfile}: its base image {image!r} is not on this Docker engine, and no image registry is "
            f"reachable (nothing is pulled). Provide it first: `docker load -i <file>.tar` of a saved copy, or "
            f"`docker build -t {image} <folder>` of your own; or build the task on rollwire's own image "
            f"(`FROM {OWN_BASE_IMAGES[0]}` or `FROM {OWN_BASE_IMAGES[1]}`, made by `rollwire images build`)")


def _context_tar(build: ImageBuild, dockerfile_text: str) -> bytes:
    """The build context as a tar: the context folder, and the generated Dockerfile beside it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(build.context, arcname=".")
        data = dockerfile_text.encode()
        info = tarfile.TarInfo(GENERATED_DOCKERFILE)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _image_exists(client: Any, name: str) -> bool:
    try:
        client.images.get(name)
    except Exception as exc:  # docker.errors.ImageNotFound; any other error is the build's to report
        if type(exc).__name__ == "ImageNotFound":
            return False
        raise
    return True


def build_image(client: Any, tag: str, build: ImageBuild) -> None:
    """``docker build`` of ``build`` as ``tag`` (blocking); :class:`RuntimeInitError` with the reason."""
    context = Path(build.context)
    dockerfile = context / build.dockerfile
    try:
        text = dockerfile.read_text(encoding="utf-8")
    except OSError as exc:
        raise RuntimeInitError(f"environment image {tag}: cannot read its Dockerfile {dockerfile}: {exc}") from exc
    bases = base_images(text)
    if not bases:
        raise RuntimeInitError(f"{dockerfile}: no FROM line")
    for base in bases:
        if "$" in base:
            continue  # an ARG-substituted base: the engine says whether it has it
        if not _image_exists(client, base):
            raise RuntimeInitError(missing_base_message(base, dockerfile))
    generated = text.rstrip("\n") + "\n" + (_SNAPSHOT if build.snapshot_workdir else "")
    try:
        payload = _context_tar(build, generated)
    except OSError as exc:
        raise RuntimeInitError(f"environment image {tag}: cannot read the build context {context}: {exc}") from exc
    log: list[str] = []
    try:
        for chunk in client.api.build(fileobj=io.BytesIO(payload), custom_context=True, tag=tag,
                                      dockerfile=GENERATED_DOCKERFILE, rm=True, forcerm=True, pull=False,
                                      network_mode="host", decode=True, timeout=build.timeout_s,
                                      labels={"rollwire.build_context": str(context)}):
            if "error" in chunk:
                detail = chunk.get("errorDetail", {}).get("message") or chunk["error"]
                tail = "".join(log)[-BUILD_LOG_TAIL:]
                raise RuntimeInitError(f"building the environment image {tag} from {dockerfile} failed: "
                                       f"{detail.strip()}\n{tail}".rstrip())
            if "stream" in chunk:
                log.append(chunk["stream"])
    except RuntimeInitError:
        raise
    except Exception as exc:  # docker.errors.APIError, a read timeout past build.timeout_s
        raise RuntimeInitError(f"building the environment image {tag} from {dockerfile}: {exc}") from exc
    if not _image_exists(client, tag):
        raise RuntimeInitError(f"building {tag}: the engine reported no error but has no such image")


@dataclass
class ImageBuilds:
    """One build per image at a time: a session whose image another session is building waits for it."""

    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def ensure(self, client: Any, tag: str, build: ImageBuild) -> bool:
        """Build ``tag`` unless the engine has it (blocking); True when this call built it."""
        with self._guard:
            lock = self._locks.setdefault(tag, threading.Lock())
        with lock:
            if _image_exists(client, tag):
                return False
            build_image(client, tag, build)
            return True
