"""The harness CLIs rollwire runs, pinned, installed from npm into a cache outside the repository.

Each CLI gets its own prefix (``<cache>/harnesses/<name>-<version>``) so that versions never mix; a
marker file makes the second call free. These CLIs change their wire format often, so the versions
here are the ones whose behaviour ../shared/HARNESSES.md describes and the tests check.

A first install fetches 150-400 MB per CLI, so npm runs at ``--loglevel=http`` and its output is read for
progress (``producers.install_progress``): a line when npm starts resolving, downloading and unpacking, and
finishes, and at most one every 10 s in between, with the package counts, the prefix's size on disk and the
time so far::

    [npm pi 0.73.1 0s] installing @mariozechner/pi-coding-agent@0.73.1 into ~/.cache/rollwire/harnesses/pi-0.73.1
    [npm pi 0.73.1 0s] resolving dependencies
    [npm pi 0.73.1 10s] downloading and unpacking packages
    [npm pi 0.73.1 20s] downloading and unpacking 176 packages: 0 tarballs downloaded; 153 MB on disk
    [npm pi 0.73.1 28s] added 188 packages in 28s

(Tarballs already in npm's own cache are not downloaded again, and npm announces the packages it adds as
it goes, so both counts are a lower bound until the final line.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from producers.install_progress import Emit, NpmOutput, Reporter, dir_bytes, format_bytes, watch

_ERROR_CHARS = 2000


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
    "gemini-cli": HarnessPackage("gemini-cli", "@google/gemini-cli", "0.61.0", "gemini"),
    "opencode": HarnessPackage("opencode", "opencode-ai", "1.18.33", "opencode"),
}


class HarnessInstallError(RuntimeError):
    """npm could not install a harness CLI."""


def harness_cache() -> Path:
    return Path(os.environ.get("ROLLWIRE_CACHE_DIR") or "~/.cache/rollwire").expanduser() / "harnesses"


def ensure_harness(name: str, cache: Path | None = None, timeout_s: float = 900, progress: Emit | None = None) -> Path:
    """The path of the harness's executable, installing the pinned version first if needed.

    ``progress`` receives the install's progress lines (default: stderr); nothing is reported when the
    CLI is already installed.
    """
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
    package = f"{spec.package}@{spec.version}"
    reporter = Reporter(f"npm {spec.name} {spec.version}", progress)
    reporter.say(f"installing {package} into {prefix}")
    try:
        finished = watch([npm, "install", "--prefix", str(prefix), package, "--no-audit", "--no-fund",
                          "--loglevel=http"], NpmOutput(), reporter, timeout_s=timeout_s, tail_lines=200,
                         measure=lambda: f"{format_bytes(dir_bytes(prefix))} on disk")
    except subprocess.TimeoutExpired as exc:
        raise HarnessInstallError(f"npm install {package} took longer than {timeout_s:.0f} s; check that the "
                                  "npm registry is reachable (or npm's registry setting points at a mirror)") from exc
    except OSError as exc:
        raise HarnessInstallError(f"npm install {package}: could not run {npm}: {exc}") from exc
    if finished.returncode != 0 or not binary.exists():
        raise HarnessInstallError(f"npm install {package} failed (exit code {finished.returncode}):\n"
                                  f"{_error_tail(finished.tail)}")
    marker.write_text(f"{package}\n")
    return binary


def _error_tail(lines: list[str]) -> str:
    """The end of npm's output without its ``npm http`` progress lines (the error is in the rest)."""
    kept = [line for line in lines if not line.startswith("npm http ")] or lines
    return "\n".join(kept)[-_ERROR_CHARS:]
