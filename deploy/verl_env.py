"""verl's own virtual environment, installed once under the cache directory, for running verl's functions on
the batches rollwire's verl bridge writes (sinks/bridges/verl.py; the comparison in
tests/sinks/test_verl_bridge.py).

verl is no dependency of rollwire, and cannot share its environment: verl 0.9.1 pins ``transformers<5.11``
and rollwire's is newer. Its full dependency list (ray[default], wandb, tensorboard, vLLM's extras and a
CUDA torch) is several gigabytes; what verl's advantage and rollout-correction code imports on a CPU
(``verl.trainer.ppo.core_algos``, ``verl.trainer.ppo.rollout_corr_helper`` and the v1 trainer's
``verl.trainer.ppo.v1.utils``, whose import pulls in the trainer and agent-loop modules) is much less.
So ``<cache_dir>/verl-<version>`` is built in steps:

1. a venv;
2. ``pip install --no-deps`` of verl and of the packages that would drag PyPI's CUDA torch in
   (:data:`NO_DEPS`);
3. ``pip install`` of the rest, pinned (:data:`WITH_DEPS`);
4. torch is borrowed, not installed: a ``.pth`` file appends the vLLM environment's site-packages
   (deploy/engine/vllm_env.py; the test session installs it anyway) to ``sys.path`` *after* the venv's
   own, so verl's pinned packages (transformers 5.10) win and only what the venv lacks (torch, and the
   ``vllm`` module verl's agent loop imports) comes from there, as rollwire's reference trainer borrows
   torch (sinks/trainer/torch_env.py);
5. the import check, then a marker file with the versions and the install's seconds.

Measured on a 2-core machine (2026-11): 680 MB on disk (ray and pyarrow are most of it); 39 to 56 s, of
which 10 s is the import check; the very first install on that machine, when the wheels (about 200 MB) came
from PyPI for the first time and pip still byte-compiled every module, took 331 s. Each later call
returns at once. A file lock keeps two processes from
installing at once; an interrupted install leaves no marker and is redone from scratch. Every pip command
and its output go to ``<cache_dir>/verl-<version>.install.log``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

from deploy.engine.errors import EngineInstallError
from deploy.engine.vllm_env import ensure_vllm_env, env_python, vllm_env_dir
from deploy.engine.vllm_env import is_installed as vllm_installed
from producers.install_progress import (Emit, PipOutput, PlainOutput, Reporter, dir_bytes, format_bytes,
                                       install_lock, watch)

VERL_VERSION = "0.9.1"
NO_DEPS = (f"verl=={VERL_VERSION}", "tensordict==0.10.0", "TransferQueue==0.1.11", "peft==0.21.2",
           "torchdata==0.11.0", "accelerate==1.15.0")
"""Installed without their dependencies: each requires torch, which PyPI serves only as the CUDA build."""
WITH_DEPS = ("transformers==5.10.4", "ray==2.60.0", "omegaconf==2.3.1", "hydra-core==1.3.8", "datasets==5.2.0",
             "numpy==2.4.6", "cloudpickle==3.1.3", "packaging==25.0", "importlib_metadata==10.2.0",
             "orjson==3.13.0", "pyvers==0.1.0", "codetiming==1.4.0", "pyzmq==27.3.0", "msgspec==0.22.0",
             "psutil==7.2.2", "prometheus_client==0.26.0", "pillow==13.0.0")
"""What the modules named in the module docstring import, with their own dependencies (torch excepted)."""
CHECK_IMPORT = ("import verl, torch, transformers, verl.trainer.ppo.core_algos, verl.trainer.ppo.rollout_corr_helper, "
                "verl.trainer.ppo.v1.utils; print('verl', verl.__version__, 'torch', torch.__version__, "
                "'transformers', transformers.__version__)")
MARKER = ".rollwire-installed"
BORROWED_PTH = "zz-rollwire-borrowed-torch.pth"
PIP_TIMEOUT_S = 1200.0
PROGRESS_LABEL = "verl env"
_STEPS = 5


def verl_env_dir(cache_dir: Path) -> Path:
    """Where verl's environment for this version lives (whether or not it is installed)."""
    return Path(cache_dir).expanduser() / f"verl-{VERL_VERSION}"


def install_log(cache_dir: Path) -> Path:
    """The log of the (last) installation into ``verl_env_dir(cache_dir)``."""
    return Path(cache_dir).expanduser() / f"verl-{VERL_VERSION}.install.log"


def _site_packages(env_dir: Path) -> Path:
    return env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def is_installed(cache_dir: Path) -> bool:
    """Whether the environment was installed completely (its marker is present) and borrows its torch from
    the vLLM environment installed now (a new vLLM version means a new install here too)."""
    env_dir = verl_env_dir(cache_dir)
    if not (env_python(env_dir).exists() and vllm_installed(cache_dir)):
        return False
    try:
        marker = json.loads((env_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(marker.get("torch_from") == str(_site_packages(vllm_env_dir(cache_dir))))


def _run(step: str, command: list[str], log: Path, reporter: Reporter, *, pip: bool = False) -> list[str]:
    """One install step, its output appended to ``log``; the last lines of its output."""
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n# {step}\n$ {' '.join(command)}\n")
        out.flush()
        try:
            finished = watch(command, PipOutput() if pip else PlainOutput(step), reporter, log=out,
                             timeout_s=PIP_TIMEOUT_S, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except (subprocess.TimeoutExpired, OSError) as exc:
            raise EngineInstallError(f"{step}: {exc!r}; full log: {log}") from exc
    if finished.returncode != 0:
        tail = "\n".join(finished.tail[-20:])
        raise EngineInstallError(f"{step} failed with exit code {finished.returncode} (check that PyPI is "
                                 f"reachable and the cache directory has 1 GB free); full log: {log}\n{tail}")
    return finished.tail


def _install_lock(cache_dir: Path, reporter: Reporter) -> AbstractContextManager[None]:
    return install_lock(Path(cache_dir) / f".verl-{VERL_VERSION}.lock",
                        lambda _: f"another process is installing verl's environment; waiting "
                                  f"(log: {install_log(cache_dir)})", reporter.say)


def _install(env_dir: Path, torch_site: Path, log: Path, reporter: Reporter) -> str:
    if env_dir.exists():
        shutil.rmtree(env_dir)  # an interrupted earlier attempt: start clean
    python = str(env_python(env_dir))
    # --no-compile: pip would byte-compile every module of the 65 packages (most of the install's time on two
    # cores); Python compiles the few hundred that verl's functions import on first use instead.
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input", "install", "--progress-bar", "off",
           "--no-compile"]
    steps = iter(range(1, _STEPS + 1))

    def step(text: str) -> str:
        reporter.say(f"step {next(steps)}/{_STEPS}: {text}")
        return text

    _run(step("creating the virtual environment"), [sys.executable, "-m", "venv", str(env_dir)], log, reporter)
    _run(step(f"installing verl {VERL_VERSION} and its torch-requiring packages without dependencies"),
         [*pip, "--no-deps", *NO_DEPS], log, reporter, pip=True)
    _run(step("installing what verl's advantage and rollout-correction modules import"),
         [*pip, *WITH_DEPS], log, reporter, pip=True)
    step(f"borrowing torch from {torch_site}")
    (_site_packages(env_dir) / BORROWED_PTH).write_text(f"{torch_site}\n", encoding="utf-8")
    tail = _run(step("checking that verl's modules import"), [python, "-c", CHECK_IMPORT], log, reporter)
    return next((line for line in reversed(tail) if line.startswith("verl ")), "")


def ensure_verl_env(cache_dir: Path, progress: Emit | None = None) -> Path:
    """verl's environment under ``cache_dir``, installed first (after the vLLM environment it borrows torch
    from) unless it already is. ``progress`` receives the install's lines (default: stderr). Raises
    EngineInstallError, with the log's tail, when a step fails."""
    cache_dir = Path(cache_dir).expanduser()
    env_dir = verl_env_dir(cache_dir)
    if is_installed(cache_dir):
        return env_dir
    torch_env = ensure_vllm_env(cache_dir, progress=progress)
    torch_site = _site_packages(torch_env)
    cache_dir.mkdir(parents=True, exist_ok=True)
    reporter = Reporter(PROGRESS_LABEL, progress)
    with _install_lock(cache_dir, reporter):
        if is_installed(cache_dir):  # installed by another process while this one waited
            return env_dir
        log = install_log(cache_dir)
        log.write_text(f"# installing verl {VERL_VERSION} into {env_dir}\n", encoding="utf-8")
        reporter.say(f"installing verl {VERL_VERSION} into {env_dir}, once: about 0.7 GB on disk (log: {log})")
        started = time.monotonic()
        versions = _install(env_dir, torch_site, log, reporter)
        seconds = round(time.monotonic() - started, 1)
        size = dir_bytes(env_dir)
        (env_dir / MARKER).write_text(json.dumps({"verl": VERL_VERSION, "torch_from": str(torch_site),
                                                 "install_seconds": seconds, "bytes": size}) + "\n", encoding="utf-8")
        with log.open("a", encoding="utf-8") as out:
            out.write(f"\n# installed in {seconds} s, {format_bytes(size)}\n")
        reporter.say(f"ready in {seconds:.0f} s, {format_bytes(size)} ({versions}): {env_dir}")
    return env_dir


__all__ = ["VERL_VERSION", "ensure_verl_env", "install_log", "is_installed", "verl_env_dir"]
