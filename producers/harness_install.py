"""The harness CLIs rollwire runs, pinned, installed from npm into a cache outside the repository.

Each CLI gets its own prefix (``<cache>/harnesses/<name>-<version>``) so that versions never mix; a
marker file makes the second call free. These CLIs change their wire format often, so the versions
here are the ones whose behaviour ../shared/HARNESSES.md describes and the tests check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HarnessPackage:
    name: str
    package: str
    version: str
    binary: str


HARNESSES: dict[str, HarnessPackage] = {
    "qwen-code": HarnessPackage("qwen-code", "@qwen-code/qwen-code", "0.24.4", "qwen"),
    "pi": HarnessPackage("pi", "@mariozechner/pi-coding-agent", "0.73.1", "pi"),
    "codex": HarnessPackage("codex", "@openai/codex", "0.169.0", "codex"),
    "claude-code": HarnessPackage("claude-code", "@anthropic-ai/claude-code", "2.1.330", "claude"),
}


class HarnessInstallError(RuntimeError):
    """npm could not install a harness CLI."""


def harness_cache() -> Path:
    return Path(os.environ.get("ROLLWIRE_CACHE_DIR") or "~/.cache/rollwire").expanduser() / "harnesses"


def ensure_harness(name: str, cache: Path | None = None, timeout_s: float = 900) -> Path:
    """The path of the harness's executable, installing the pinned version first if needed."""
    spec = HARNESSES.get(name)
    if spec is None:
        raise HarnessInstallError(f"unknown harness {name!r}; known: {sorted(HARNESSES)}")
    prefix = (cache or harness_cache()) / f"{spec.name}-{spec.version}"
    binary = prefix / "node_modules" / ".bin" / spec.binary
    marker = prefix / ".rollwire-installed"
    if marker.exists() and binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise HarnessInstallError("npm not found on PATH: install Node.js 20 with npm (apt-get install nodejs npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([npm, "install", "--prefix", str(prefix), f"{spec.package}@{spec.version}",
                             "--no-audit", "--no-fund", "--loglevel=error"],
                            capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0 or not binary.exists():
        raise HarnessInstallError(f"npm install {spec.package}@{spec.version} failed:\n{result.stderr[-2000:]}")
    marker.write_text(f"{spec.package}@{spec.version}\n")
    return binary
