"""Resolving the Apache Kafka broker's jars through Maven into a cache outside the repository.

No tarball is downloaded: ``mvn dependency:copy-dependencies`` on a generated pom puts the broker and its
runtime dependencies in ``<cache>/kafka/<version>/libs``. A marker file makes the second call free.
"""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

from deploy.errors import MissingToolError, ResolveError

LOG4J_VERSION = "2.24.3"
_MARKER = ".resolved"


def require_tool(name: str, install_hint: str) -> str:
    """Path of ``name`` on PATH, or MissingToolError saying how to install it."""
    path = shutil.which(name)
    if path is None:
        raise MissingToolError(f"{name} not found on PATH: rollwire's local Kafka needs it. "
                               f"Install it, e.g. `{install_hint}`")
    return path


def require_java() -> str:
    return require_tool("java", "apt-get install openjdk-17-jre-headless")


def template(name: str) -> str:
    return resources.files("deploy").joinpath("kafka", name).read_text(encoding="utf-8")


def resolve_kafka(version: str, cache_dir: Path, timeout_s: float = 900) -> Path:
    """The directory of the broker's jars for ``version``, resolving them first if needed."""
    home = cache_dir / "kafka" / version
    libs = home / "libs"
    if (home / _MARKER).exists():
        return libs
    mvn = require_tool("mvn", "apt-get install maven")
    require_java()
    home.mkdir(parents=True, exist_ok=True)
    pom = template("pom.xml").replace("@KAFKA_VERSION@", version).replace("@LOG4J_VERSION@", LOG4J_VERSION)
    (home / "pom.xml").write_text(pom, encoding="utf-8")
    if libs.exists():
        shutil.rmtree(libs)  # a half-finished earlier attempt
    command = [mvn, "-B", "-q", "dependency:copy-dependencies", f"-DoutputDirectory={libs}",
               "-DincludeScope=runtime"]
    try:
        result = subprocess.run(command, cwd=home, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ResolveError(f"Maven took longer than {timeout_s:.0f} s to resolve Kafka {version}") from exc
    if result.returncode != 0 or not any(libs.glob("kafka_2.13-*.jar")):
        tail = (result.stdout + result.stderr).strip().splitlines()[-20:]
        raise ResolveError(f"Maven could not resolve org.apache.kafka:kafka_2.13:{version} "
                           f"(check the version exists and Maven Central is reachable):\n" + "\n".join(tail))
    (home / _MARKER).write_text(version, encoding="utf-8")
    return libs
