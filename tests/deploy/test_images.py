"""Images made offline (deploy/images.py) on the real Docker engine: what their containers can run.

The module builds every image once (``rollwire images build``'s routine: a cold base takes about a
minute, the harness image about half a minute; both are cached across runs in the engine and under
``~/.cache/rollwire/images``), then checks the tools in a base container, the pinned CLIs in a harness
container, the SWE images' /testbed at base_commit, that a second build is a cache hit, the
deterministic commit, and that a repository whose commit is not the instance's base_commit fails the build.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from deploy.docker_engine import client_for, ensure_engine
from deploy.images import (BASE_IMAGE, DEFAULT_INSTANCES, HARNESS_IMAGE, LABEL_BASE_COMMIT, LABEL_HARNESS_CACHE,
                           LABEL_HARNESS_PINS, LABEL_INPUTS, BuildResult, ImageBuildError, ImageBuilder,
                           commit_repository, debian_mirror, swe_images)
from producers.harness_install import HARNESSES, harness_cache

INSTANCES = DEFAULT_INSTANCES if DEFAULT_INSTANCES.is_file() else None


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    previous = os.environ.get("DOCKER_HOST")
    docker = client_for(ensure_engine(), timeout_s=3600)
    yield docker
    docker.close()
    if previous is None:
        os.environ.pop("DOCKER_HOST", None)
    else:
        os.environ["DOCKER_HOST"] = previous


@pytest.fixture(scope="module")
def built(client: Any) -> list[BuildResult]:
    lines: list[str] = []
    results = ImageBuilder(client, say=lines.append).build(INSTANCES)
    print("\n".join(lines))
    return results


def _run(client: Any, image: str, script: str) -> str:
    output = client.containers.run(image, ["sh", "-c", script + " 2>&1"], remove=True, network_mode="none")
    return bytes(output).decode()


def test_base_image_has_git_python_pytest_patch_and_node_20(client: Any, built: list[BuildResult]) -> None:
    assert [r.image for r in built[:2]] == [BASE_IMAGE, HARNESS_IMAGE]
    out = _run(client, BASE_IMAGE, "set -e; git --version; python3 -m pytest --version; patch --version; "
                                   "ps --version; node --version; command -v node; pwd")
    lines = out.splitlines()
    assert lines[0].startswith("git version 2.")
    assert any(line.startswith("pytest ") for line in lines)
    assert any(line.startswith("GNU patch") for line in lines)
    assert "v20." in out and "/usr/local/bin/node" in lines
    assert lines[-1] == "/"


def test_a_second_build_is_a_cache_hit(client: Any, built: list[BuildResult]) -> None:
    started = time.monotonic()
    again = ImageBuilder(client, say=lambda _: None).build(INSTANCES)
    assert time.monotonic() - started < 20
    assert [r.status for r in again] == ["cached"] * len(built)
    assert [r.image_id for r in again] == [r.image_id for r in built]


def test_harness_image_runs_the_pinned_clis_at_the_harness_cache_path(client: Any, built: list[BuildResult]) -> None:
    cache = harness_cache()
    labels = client.images.get(HARNESS_IMAGE).labels
    assert labels[LABEL_HARNESS_CACHE] == str(cache)
    assert labels[LABEL_HARNESS_PINS] == ",".join(f"{h.name}={h.version}" for h in
                                                 sorted(HARNESSES.values(), key=lambda h: h.name))
    # Node scripts through the image's node; opencode is a native (Bun-compiled) binary.
    for name, runner in (("qwen-code", "node "), ("pi", "node "), ("gemini-cli", "node "), ("opencode", "")):
        spec = HARNESSES[name]
        binary = cache / f"{spec.name}-{spec.version}" / "node_modules" / ".bin" / spec.binary
        out = _run(client, HARNESS_IMAGE, f"{runner}{binary} --version")
        assert out.strip().splitlines()[-1] == spec.version, out


def test_swe_images_hold_their_repository_at_base_commit(client: Any, built: list[BuildResult]) -> None:
    assert INSTANCES is not None, "examples/swebench/instances.jsonl is missing"
    swes = swe_images(INSTANCES)
    assert swes and [r.image for r in built[2:]] == [s.image for s in swes]
    for swe in swes:
        image = client.images.get(swe.image)
        assert image.labels[LABEL_BASE_COMMIT] == swe.base_commit
        out = _run(client, swe.image, "pwd; git rev-parse HEAD; git status --porcelain | wc -l; ls /root/.cache")
        assert out.splitlines()[:3] == ["/testbed", swe.base_commit, "0"], out


def _tree(root: Path, modes: tuple[int, int]) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("def answer():\n    return 42\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_pkg.py").write_text("from pkg import answer\n\n\ndef test_answer():\n"
                                                "    assert answer() == 42\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", modes[0])
    os.chmod(root / "pkg" / "__init__.py", modes[1])
    return root


def test_commit_repository_is_deterministic(tmp_path: Path) -> None:
    one = _tree(tmp_path / "one", (0o755, 0o600))
    two = _tree(tmp_path / "two", (0o644, 0o664))
    (two / "pkg" / "__pycache__").mkdir()  # what running the tests leaves is not part of the repository
    (two / "pkg" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0junk")
    os.utime(two / "pkg" / "__init__.py", (1, 1))
    first = commit_repository(one, tmp_path / "a" / "repo")
    second = commit_repository(two, tmp_path / "b")
    assert len(first) == 40 and first == second
    assert (tmp_path / "a" / "repo" / "run.sh").stat().st_mode & 0o777 == 0o644
    (two / "pkg" / "__init__.py").write_text("def answer():\n    return 43\n")
    assert commit_repository(two, tmp_path / "c") != first
    with pytest.raises(ImageBuildError, match="not empty"):
        commit_repository(one, tmp_path / "b")


def _instance_file(folder: Path, instance_id: str, base_commit: str, image: str) -> Path:
    path = folder / "instances.jsonl"
    path.write_text(json.dumps({"instance_id": instance_id, "repo": "rollwire/tmp", "base_commit": base_commit,
                                "problem_statement": "answer is wrong", "image_name": image,
                                "FAIL_TO_PASS": ["tests/test_pkg.py::test_answer"]}) + "\n")
    return path


def test_an_instance_image_from_a_tmp_instance_file(client: Any, built: list[BuildResult], tmp_path: Path) -> None:
    instance_id = f"tmp__answer-{uuid.uuid4().hex[:6]}"
    source = _tree(tmp_path / "repos" / instance_id, (0o755, 0o644))
    commit = commit_repository(source, tmp_path / "expected")
    image = f"rollwire/swe-test-{instance_id.replace('__', '-')}:latest"
    instances = _instance_file(tmp_path, instance_id, commit, image)
    builder = ImageBuilder(client, say=lambda _: None)
    try:
        [swe] = swe_images(instances)
        result = builder.build_swe(swe)
        assert result.status == "built"
        assert client.images.get(image).labels[LABEL_INPUTS] == builder.swe_digest(swe)
        out = _run(client, image, "git rev-parse HEAD; python3 -m pytest -q -p no:cacheprovider tests | tail -1")
        assert out.splitlines()[0] == commit and "1 passed" in out, out
        assert builder.build_swe(swe).status == "cached"

        # The repository changed but base_commit did not: the build refuses, naming both.
        (source / "pkg" / "__init__.py").write_text("def answer():\n    return 0\n")
        [changed] = swe_images(instances)
        with pytest.raises(ImageBuildError, match=f"not its base_commit {commit}"):
            builder.build_swe(changed)
        assert client.images.get(image).id == result.image_id  # the good image is left as it was
    finally:
        client.images.remove(image, force=True)


def test_images_list_shows_sizes_and_freshness(built: list[BuildResult]) -> None:
    result = CliRunner().invoke(app, ["images", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["image"]: row for row in map(json.loads, result.output.splitlines())}
    for build in built:
        assert rows[build.image]["up_to_date"] is True
        assert rows[build.image]["size_bytes"] > 100_000_000


def test_debian_mirror_is_read_from_the_apt_sources(tmp_path: Path) -> None:
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
                      "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
                      "Components: main\n")
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb [arch=amd64] http://other.example/debian bookworm main\n")
    assert debian_mirror([deb822, one_line]) == "http://mirror.example/debian"
    assert debian_mirror([tmp_path / "missing", one_line]) == "http://other.example/debian"
    assert debian_mirror([tmp_path / "missing"]) == "http://deb.debian.org/debian"
