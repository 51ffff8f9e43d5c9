"""The Apache Kafka broker's jars, resolved through Maven into a cache outside the repository.

No tarball is downloaded. ``resolve_kafka`` writes a pom naming ``org.apache.kafka:kafka_2.13:<version>``
into ``<cache>/kafka/<version>/``, runs ``mvn dependency:copy-dependencies`` into a staging folder, adds the
slf4j -> log4j2 binding at the log4j version that Kafka release depends on (the official distribution
ships it; the published poms do not name it), then swaps the staging folder in as ``libs/`` and writes a
marker. The marker names the recipe (a digest of the pom and the steps), so a second call costs one file
read and a changed recipe resolves again. A file lock keeps concurrent callers from resolving twice.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from deploy.errors import MissingToolError, ResolveError

DEPENDENCY_PLUGIN_VERSION = "3.8.1"
MIN_JAVA = 17
_MARKER = ".resolved"
# Part of the marker: change it when the steps below change, so that existing caches resolve again.
_STEPS = "copy-dependencies(runtime)+log4j-slf4j-binding"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def require_java() -> str:
    """Path of a Java 17+ ``java`` on PATH, or MissingToolError saying how to install one."""
    java = shutil.which("java")
    hint = "install it, e.g. `apt-get install openjdk-17-jre-headless`"
    if java is None:
        raise MissingToolError(f"Java {MIN_JAVA}+ not found on PATH: {hint}")
    major = java_major(java)
    if major < MIN_JAVA:
        raise MissingToolError(f"Java {MIN_JAVA}+ not found on PATH: {java} is Java {major}; {hint}, "
                               "and put it first on PATH")
    return java


def require_maven() -> str:
    """Path of ``mvn`` on PATH, or MissingToolError saying how to install it."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingToolError("mvn not found on PATH: install it, e.g. `apt-get install maven` (Maven "
                               "resolves the Kafka broker's jars once)")
    return mvn


@functools.lru_cache(maxsize=8)
def java_major(java: str) -> int:
    """The feature version (8, 11, 17, 21, ...) of the ``java`` executable at ``java``."""
    try:
        result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MissingToolError(f"Java {MIN_JAVA}+ not found on PATH: {java} -version failed ({exc}); "
                               "install it, e.g. `apt-get install openjdk-17-jre-headless`") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if match is None:
        raise MissingToolError(f"could not read the Java version from `{java} -version`: "
                               f"{(result.stderr + result.stdout).strip()[:200]!r}")
    first, second = int(match.group(1)), int(match.group(2) or 0)
    return second if first == 1 else first  # "1.8.0_292" is Java 8


def template(name: str) -> str:
    """A file from ``deploy/kafka/`` (package data)."""
    return resources.files("deploy").joinpath("kafka", name).read_text(encoding="utf-8")


def distribution_dir(version: str, cache_dir: Path) -> Path:
    """Where the jars of Kafka ``version`` are kept: ``<cache_dir>/kafka/<version>``."""
    return cache_dir / "kafka" / version


def _pom(version: str) -> str:
    return (template("pom.xml").replace("@KAFKA_VERSION@", version)
            .replace("@DEPENDENCY_PLUGIN_VERSION@", DEPENDENCY_PLUGIN_VERSION))


def _recipe(pom: str) -> str:
    return hashlib.sha256(f"{_STEPS}\n{pom}".encode()).hexdigest()[:16]


def is_resolved(version: str, cache_dir: Path) -> bool:
    """Whether the jars of ``version`` are complete in the cache, for the current recipe."""
    marker = distribution_dir(version, cache_dir) / _MARKER
    try:
        return marker.read_text(encoding="utf-8").split() == [version, _recipe(_pom(version))]
    except OSError:
        return False


def resolve_kafka(version: str, cache_dir: Path, timeout_s: float = 900) -> Path:
    """The folder of the broker's jars for ``version`` (``.../libs``), resolving them first if needed."""
    home = distribution_dir(version, cache_dir)
    if is_resolved(version, cache_dir):
        return home / "libs"
    mvn = require_maven()
    require_java()
    home.mkdir(parents=True, exist_ok=True)
    with file_lock(home / ".lock"):
        if is_resolved(version, cache_dir):  # another process finished it while we waited
            return home / "libs"
        pom = _pom(version)
        (home / "pom.xml").write_text(pom, encoding="utf-8")
        staging = home / "libs.partial"
        shutil.rmtree(staging, ignore_errors=True)
        _maven(mvn, home, timeout_s, version, "dependency:copy-dependencies", f"-DoutputDirectory={staging}",
               "-DincludeScope=runtime")
        if not (staging / f"kafka_2.13-{version}.jar").exists():
            raise ResolveError(f"Maven finished but {staging} has no kafka_2.13-{version}.jar; delete {home} "
                               "and try again")
        binding = _slf4j_binding(staging, version)
        _maven(mvn, home, timeout_s, version, "dependency:copy", f"-Dartifact={binding}",
               f"-DoutputDirectory={staging}")
        _swap_in(staging, home / "libs")
        (home / _MARKER).write_text(f"{version} {_recipe(pom)}\n", encoding="utf-8")
    return home / "libs"


def _slf4j_binding(libs: Path, version: str) -> str:
    """Maven coordinates of the log4j2 binding for the slf4j API and the log4j version Kafka brought."""
    log4j = _jar_version(libs, "log4j-api")
    slf4j = _jar_version(libs, "slf4j-api")
    if log4j is None or slf4j is None:
        raise ResolveError(f"Kafka {version} did not bring log4j-api and slf4j-api; rollwire runs Kafka 4.x "
                           "(log4j2): set ROLLWIRE_KAFKA_VERSION to a 4.x release such as 4.3.1")
    artifact = "log4j-slf4j2-impl" if slf4j.startswith("2.") else "log4j-slf4j-impl"
    return f"org.apache.logging.log4j:{artifact}:{log4j}"


def _jar_version(libs: Path, artifact: str) -> str | None:
    for jar in libs.glob(f"{artifact}-*.jar"):
        rest = jar.name[len(artifact) + 1:-len(".jar")]
        if rest[:1].isdigit():
            return rest
    return None


def _maven(mvn: str, cwd: Path, timeout_s: float, version: str, *args: str) -> None:
    command = [mvn, "-B", "-q", "-Dstyle.color=never", *args]
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ResolveError(f"Maven took longer than {timeout_s:.0f} s resolving Kafka {version}; check that "
                           "Maven Central (or your mirror in ~/.m2/settings.xml) is reachable") from exc
    except OSError as exc:
        raise ResolveError(f"could not run {mvn}: {exc}") from exc
    if result.returncode != 0:
        tail = _ANSI.sub("", result.stdout + result.stderr).strip().splitlines()[-25:]
        raise ResolveError(f"`mvn {' '.join(args[:1])}` failed for org.apache.kafka:kafka_2.13:{version} "
                           "(check that the version exists and Maven Central is reachable):\n" + "\n".join(tail))


def _swap_in(staging: Path, libs: Path) -> None:
    """Replace ``libs`` by ``staging`` with renames, so that ``libs`` is never half-filled."""
    old = libs.with_name("libs.old")
    shutil.rmtree(old, ignore_errors=True)
    if libs.exists():
        libs.rename(old)
    staging.rename(libs)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the duration of the block."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
