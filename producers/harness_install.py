"""The harness CLIs rollwire runs, pinned, installed from npm into a cache outside the repository.

Each CLI gets its own prefix (``<cache>/harnesses/<name>-<version>``) so that versions never mix. These
CLIs change their wire format often, so the versions here are the ones whose behaviour
docs/harnesses.md describes and the tests check.

**One install per prefix, never a half-installed one.** Many sessions start at once, in one gateway node
or in several on one host, and each asks for its harness. So:

- an install holds an exclusive ``fcntl`` lock on ``<cache>/harnesses/.<name>-<version>.lock`` (a lock of
  the kernel's, so separate processes wait for it too, and a process that dies lets it go); a caller that
  finds it held says so and waits, then finds the CLI installed;
- npm installs into a temporary prefix next to the final one (``.<name>-<version>.tmp-<pid>``), and that
  prefix is renamed into place only after ``<binary> --version`` ran there and exited 0: a prefix at the
  final path is always whole (a rename is atomic), whatever npm did or whoever was killed meanwhile;
- a prefix that is there but whose binary is missing or does not run (a copy left by an older rollwire
  without this protocol, a file removed by hand) is *broken*: it is moved aside and installed again. A
  prefix is checked this way once per process (and again whenever it changes); later calls cost a
  ``stat``.

A first install fetches 150-400 MB per CLI, so npm runs at ``--loglevel=http`` and its output is read for
progress (``producers.install_progress``): a line when npm starts resolving, downloading and unpacking, and
finishes, and at most one every 10 s in between, with the package counts, the prefix's size on disk and the
time so far::

    [npm pi 0.73.1 0s] installing @mariozechner/pi-coding-agent@0.73.1 into ~/.cache/rollwire/harnesses/pi-0.73.1
    [npm pi 0.73.1 0s] resolving dependencies
    [npm pi 0.73.1 10s] downloading and unpacking packages
    [npm pi 0.73.1 20s] downloading and unpacking 176 packages: 0 tarballs downloaded; 153 MB on disk
    [npm pi 0.73.1 28s] added 188 packages in 28s
    [npm pi 0.73.1 29s] checked: pi --version says 0.73.1

(Tarballs already in npm's own cache are not downloaded again, and npm announces the packages it adds as
it goes, so both counts are a lower bound until the final line.) The main job and ``rollwire up`` call
:func:`ensure_harness` before they submit anything, so these lines appear in the user's own terminal;
a gateway node then finds the CLI installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from producers.errors import HarnessInstallError as HarnessInstallError
from producers.install_progress import (Emit, NpmOutput, Reporter, dir_bytes, format_bytes, install_lock,
                                       to_stderr, watch)
from schemas import paths

_ERROR_CHARS = 2000
MARKER = ".rollwire-installed"
VERSION_TIMEOUT_S = 60.0
"""How long ``<binary> --version`` may take (a cold Node.js start of a large CLI takes a few seconds)."""


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


def harness_cache() -> Path:
    return paths.cache_dir() / "harnesses"


def harness_prefix(name: str, cache: Path | None = None) -> Path:
    """Where the pinned version of harness ``name`` is (or would be) installed."""
    spec = _spec(name)
    return (cache or harness_cache()) / f"{spec.name}-{spec.version}"


# Prefixes whose binary ran in this process, with the marker's mtime then: a changed prefix is checked again.
_verified: dict[Path, int] = {}
_verified_lock = threading.Lock()


def ensure_harness(name: str, cache: Path | None = None, timeout_s: float = 900, progress: Emit | None = None) -> Path:
    """The path of the harness's executable, installing the pinned version first if needed.

    Safe to call from many threads and processes at once (see the module docstring). ``progress``
    receives the install's progress lines (default: stderr); nothing is reported when the CLI is
    installed and runs.
    """
    spec = _spec(name)
    prefix = harness_prefix(name, cache)
    binary = _binary(prefix, spec)
    if _known_good(prefix, binary):
        return binary
    emit = progress or to_stderr
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with _install_lock(prefix, spec, emit):
        # Whoever held the lock before may have installed it meanwhile.
        problem = _check(prefix, binary)
        if problem is None:
            _remember(prefix)
            return binary
        if prefix.exists() or prefix.is_symlink():
            emit(f"[npm {spec.name} {spec.version}] {prefix} is broken ({problem}); installing it again")
        _install(spec, prefix, timeout_s, emit)
        _remember(prefix)
        return binary


def _spec(name: str) -> HarnessPackage:
    spec = HARNESSES.get(name)
    if spec is None:
        raise HarnessInstallError(f"unknown harness {name!r}; known: {sorted(HARNESSES)}")
    return spec


def _binary(prefix: Path, spec: HarnessPackage) -> Path:
    return prefix / "node_modules" / ".bin" / spec.binary


def _marker_mtime(prefix: Path) -> int | None:
    try:
        return (prefix / MARKER).stat().st_mtime_ns
    except OSError:
        return None


def _known_good(prefix: Path, binary: Path) -> bool:
    mtime = _marker_mtime(prefix)
    with _verified_lock:
        return mtime is not None and _verified.get(prefix) == mtime and binary.exists()


def _remember(prefix: Path) -> None:
    mtime = _marker_mtime(prefix)
    if mtime is not None:
        with _verified_lock:
            _verified[prefix] = mtime


def _install_lock(prefix: Path, spec: HarnessPackage, emit: Emit) -> contextlib.AbstractContextManager[None]:
    """Hold the prefix's install lock (waiting, and saying so, while another process holds it)."""
    return install_lock(prefix.parent / f".{prefix.name}.lock",
                        lambda holder: f"[npm {spec.name} {spec.version}] waiting for the install that {holder} is running",
                        emit)


def _runs(binary: Path) -> tuple[bool, str]:
    """Whether ``binary --version`` exits 0, and what it printed (or why it did not run)."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"--version did not answer within {VERSION_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return False, f"it does not start: {exc}"
    output = (done.stdout.strip() or done.stderr.strip())
    if done.returncode != 0:
        first = "\n".join(output.splitlines()[:3])[:500]
        return False, f"--version exited {done.returncode}: {first}"
    return True, output.splitlines()[0][:200] if output else ""


def _check(prefix: Path, binary: Path) -> str | None:
    """None when the prefix is whole and its binary runs; else what is wrong with it."""
    if not prefix.exists():
        return "not installed"
    if not (prefix / MARKER).exists():
        return "no install marker: an install did not finish there"
    if not binary.exists():
        return f"{binary.name} is missing"
    ok, said = _runs(binary)
    return None if ok else said


def _install(spec: HarnessPackage, prefix: Path, timeout_s: float, emit: Emit) -> None:
    """npm into a temporary prefix, ``--version`` there, then rename it into place (the old one moved aside)."""
    npm = shutil.which("npm")
    if npm is None:
        raise HarnessInstallError("npm not found on PATH: install Node.js 20 with npm (apt-get install nodejs npm)")
    temporary = prefix.parent / f".{prefix.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    _remove(temporary)
    temporary.mkdir(parents=True)
    package = f"{spec.package}@{spec.version}"
    reporter = Reporter(f"npm {spec.name} {spec.version}", emit)
    reporter.say(f"installing {package} into {prefix}")
    try:
        try:
            finished = watch([npm, "install", "--prefix", str(temporary), package, "--no-audit", "--no-fund",
                              "--loglevel=http"], NpmOutput(), reporter, timeout_s=timeout_s, tail_lines=200,
                             measure=lambda: f"{format_bytes(dir_bytes(temporary))} on disk")
        except subprocess.TimeoutExpired as exc:
            raise HarnessInstallError(f"npm install {package} took longer than {timeout_s:.0f} s; check that the "
                                      "npm registry is reachable (or npm's registry setting points at a mirror)") from exc
        except OSError as exc:
            raise HarnessInstallError(f"npm install {package}: could not run {npm}: {exc}") from exc
        installed = _binary(temporary, spec)
        if finished.returncode != 0 or not installed.exists():
            raise HarnessInstallError(f"npm install {package} failed (exit code {finished.returncode}):\n"
                                      f"{_error_tail(finished.tail)}")
        ok, said = _runs(installed)
        if not ok:
            raise HarnessInstallError(f"npm installed {package}, but {spec.binary} does not run: {said}")
        reporter.say(f"checked: {spec.binary} --version says {said or '(nothing)'}")
        (temporary / MARKER).write_text(f"{package}\n")
        if prefix.exists() or prefix.is_symlink():
            aside = prefix.parent / f".{prefix.name}.broken-{os.getpid()}-{time.monotonic_ns()}"
            prefix.rename(aside)
            _remove(aside)
        temporary.rename(prefix)
    finally:
        _remove(temporary)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _error_tail(lines: list[str]) -> str:
    """The end of npm's output without its ``npm http`` progress lines (the error is in the rest)."""
    kept = [line for line in lines if not line.startswith("npm http ")] or lines
    return "\n".join(kept)[-_ERROR_CHARS:]
