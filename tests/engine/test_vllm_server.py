"""The embedded engine: its launcher, and the real vLLM CPU server over the tiny model.

The launcher tests (configuration, command line, environment, install errors, stopping a process group)
need no vLLM. The server tests use the session's one real server (the ``vllm_url`` fixture in
tests/conftest.py: it installs vLLM's environment on first use, builds the model, and starts vLLM on a
free port; ``ROLLWIRE_TEST_ENGINE_URL`` reuses one that is up) and assert what the proxy and the
trajectory builders rely on: prompt ids equal to ``/tokenize``'s, one logprob per sampled token, a forced
tool call parsed into ``tool_calls`` whole and streamed, and the same ids for the same seed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.engine import vllm_env
from deploy.engine.errors import EngineInstallError, EngineStartError
from deploy.engine.server import EngineConfig, VllmServer, engine_ready, server_command, server_env
from deploy.errors import ConfigError

# The first test that asks for the server may install vLLM's environment (minutes) and start it (~1 min).
pytestmark = pytest.mark.timeout(1800)

MODEL = "rollwire-tiny"
MESSAGES: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": "List the files, then fix the failing test."}]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "shell", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
FORCED_CALL = r'<tool_call>\n\{"name": "shell", "arguments": \{"command": "echo hi"\}\}\n</tool_call>'


def _chat(client: httpx.Client, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "seed": 7, "temperature": 1.0,
            "return_token_ids": True, "logprobs": True, **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _stream(client: httpx.Client, **extra: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "seed": 7, "temperature": 1.0,
            "return_token_ids": True, "logprobs": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture(scope="module")
def client(vllm_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_url, timeout=120) as engine:
        yield engine


# --- launcher, without vLLM -----------------------------------------------------------------------


def test_config_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLWIRE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ROLLWIRE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ROLLWIRE_ENGINE_PORT", "18555")
    monkeypatch.setenv("ROLLWIRE_ENGINE_SEED", "3")
    monkeypatch.setenv("ROLLWIRE_ENGINE_ARGS", "--max-num-batched-tokens 2048")
    config = EngineConfig.from_env()
    assert config.cache_dir == tmp_path / "cache" and config.home == tmp_path / "home" / "engine"
    assert config.url == "http://127.0.0.1:18555" and config.seed == 3
    assert config.model_dir == tmp_path / "cache" / "models" / "tiny-qwen3-seed3"
    assert config.extra_args == ("--max-num-batched-tokens", "2048")
    assert VllmServer(config).url == config.url


@pytest.mark.parametrize("bad", [{"port": 0}, {"logprobs_mode": "processed"}, {"max_model_len": 0},
                                 {"seed": -1}, {"served_model_name": ""}])
def test_bad_config_fails_in_the_constructor(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(**bad)


def test_bad_port_variable_says_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_ENGINE_PORT", "eighteen")
    with pytest.raises(ConfigError, match="ROLLWIRE_ENGINE_PORT"):
        EngineConfig.from_env()


def test_command_line_carries_the_lean_cpu_flags(tmp_path: Path) -> None:
    config = EngineConfig(cache_dir=tmp_path, home=tmp_path / "home", port=18321, seed=5)
    command = server_command(Path("/venv/bin/python"), config, config.model_dir)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(command)
    for flag in ("--enforce-eager", "--dtype float32", "--max-model-len 4096", "--kv-cache-memory-bytes 64M",
                 "--max-num-seqs 16", "--max-num-batched-tokens 4096", "--enable-auto-tool-choice",
                 "--tool-call-parser hermes",
                 "--logprobs-mode processed_logprobs", "--seed 5", "--port 18321", "--served-model-name rollwire-tiny",
                 f"--chat-template {config.model_dir / 'chat_template.jinja'}"):
        assert flag in flags


def test_server_environment_is_offline_and_cpu_only(tmp_path: Path) -> None:
    config = EngineConfig(cache_dir=tmp_path, home=tmp_path / "home")
    env = server_env(config, {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "", "CUDA_VISIBLE_DEVICES": "0"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["TORCHDYNAMO_DISABLE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "home" / "vllm-cache")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # an empty value crashes vLLM's CPU worker
    assert env["PATH"] == "/bin"


def test_installed_environment_is_reused_at_once(tmp_path: Path) -> None:
    env_dir = vllm_env.vllm_env_dir(tmp_path)
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").touch()
    (env_dir / vllm_env.MARKER).write_text("{}")
    started = time.monotonic()
    assert vllm_env.ensure_vllm_env(tmp_path) == env_dir
    assert time.monotonic() - started < 0.5


def test_failed_install_raises_with_the_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_env.sys, "executable", "/bin/false")
    with pytest.raises(EngineInstallError, match="creating the virtual environment") as failure:
        vllm_env.ensure_vllm_env(tmp_path)
    assert str(vllm_env.install_log(tmp_path)) in str(failure.value)
    assert not vllm_env.is_installed(tmp_path)


def test_start_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = EngineConfig(cache_dir=tmp_path / "cache", home=tmp_path / "home", port=busy.getsockname()[1])
        with pytest.raises(EngineStartError, match="ROLLWIRE_ENGINE_PORT"):
            VllmServer(config).start()
    assert not (tmp_path / "cache").exists()  # refused before installing anything


def _fake_server(home: Path, ignore_term: bool) -> subprocess.Popen[bytes]:
    """A process group that looks like vLLM's (the entrypoint on its command line) with one child."""
    trap = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_term else ""
    code = (f"{trap}import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", code, "vllm.entrypoints.openai.api_server"],
                               start_new_session=True)
    home.mkdir(parents=True, exist_ok=True)
    (home / "vllm.pid").write_text(str(process.pid))
    time.sleep(0.5)
    return process


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (a zombie waits for its new parent to reap it)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            live.append(int(stat.parent.name))
    return live


@pytest.mark.parametrize("ignore_term", [False, True])
def test_stop_ends_the_whole_process_group(tmp_path: Path, ignore_term: bool) -> None:
    """vLLM's engine core runs in child processes: stopping only the API server would orphan them."""
    server = VllmServer(EngineConfig(cache_dir=tmp_path, home=tmp_path / "home"))
    process = _fake_server(tmp_path / "home", ignore_term)
    assert server.is_running() and server.status()["pid"] == process.pid
    server.stop(timeout_s=1 if ignore_term else 10)
    assert process.poll() is not None
    assert not server.is_running() and not server.pid_file.exists()
    assert _live_members(process.pid) == []
    server.stop()  # a second stop is harmless


def test_stop_cleans_up_after_a_crashed_server(tmp_path: Path) -> None:
    """An API server that died leaves its engine core running: stop() (and so start()) must end it."""
    code = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
            "'VLLM::EngineCore'])")
    leader = subprocess.Popen([sys.executable, "-c", code, "vllm.entrypoints.openai.api_server"],
                              start_new_session=True)
    leader.wait(timeout=30)
    home = tmp_path / "home"
    home.mkdir()
    (home / "vllm.pid").write_text(str(leader.pid))
    time.sleep(0.3)
    server = VllmServer(EngineConfig(cache_dir=tmp_path, home=home))
    assert not server.is_running() and _live_members(leader.pid)
    server.stop(timeout_s=10)
    assert _live_members(leader.pid) == [] and not server.pid_file.exists()


# --- the real server ------------------------------------------------------------------------------


def test_server_is_ready_and_serves_the_tiny_model(vllm_url: str, client: httpx.Client) -> None:
    assert engine_ready(vllm_url, MODEL)
    [model] = client.get("/v1/models").json()["data"]
    assert model["id"] == MODEL and model["max_model_len"] >= 4096


@pytest.mark.parametrize("extra", [
    {},
    {"tools": TOOLS},
    {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
])
def test_prompt_ids_equal_tokenize(client: httpx.Client, extra: dict[str, Any]) -> None:
    reply = _chat(client, **extra)
    tokenized = client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True,
                                               **extra}).json()
    assert reply["prompt_token_ids"] == tokenized["tokens"]
    assert reply["prompt_token_ids"][:3] == [151644, 8948, 198]  # <|im_start|>system\n
    if extra.get("chat_template_kwargs"):  # thinking off: the prompt ends with an empty think block
        assert reply["prompt_token_ids"][-4:] == [151667, 271, 151668, 271]


def test_one_logprob_per_sampled_token(client: httpx.Client) -> None:
    [choice] = _chat(client, max_tokens=20, top_logprobs=2)["choices"]
    entries = choice["logprobs"]["content"]
    assert len(choice["token_ids"]) == len(entries) == 20
    assert all(e["logprob"] <= 0.0 and len(e["top_logprobs"]) == 2 for e in entries)


def test_stream_carries_ids_and_logprobs_in_every_chunk(client: httpx.Client) -> None:
    chunks = _stream(client)
    assert chunks[0]["prompt_token_ids"]
    token_chunks = [c for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]
    for chunk in token_chunks:
        choice = chunk["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    assert sum(len(c["choices"][0]["token_ids"]) for c in token_chunks) == 16


def test_same_seed_same_ids_whole_and_streamed(client: httpx.Client) -> None:
    first, second = _chat(client, seed=123), _chat(client, seed=123)
    other = _chat(client, seed=124)
    ids = first["choices"][0]["token_ids"]
    assert ids == second["choices"][0]["token_ids"] and ids != other["choices"][0]["token_ids"]
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    streamed = [i for c in _stream(client, seed=123) if c["choices"] for i in c["choices"][0].get("token_ids") or ()]
    assert streamed == ids


def test_forced_tool_call_comes_back_as_tool_calls(client: httpx.Client) -> None:
    reply = _chat(client, tools=TOOLS, tool_choice="auto", max_tokens=64,
                  structured_outputs={"regex": FORCED_CALL})
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "shell" and json.loads(call["function"]["arguments"]) == {"command": "echo hi"}
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"])


def test_forced_tool_call_streams_as_tool_call_deltas(client: httpx.Client) -> None:
    chunks = _stream(client, tools=TOOLS, tool_choice="auto", max_tokens=64,
                     structured_outputs={"regex": FORCED_CALL})
    deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert "".join(d["function"].get("name") or "" for d in deltas) == "shell"
    assert json.loads("".join(d["function"].get("arguments") or "" for d in deltas)) == {"command": "echo hi"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_prompt_over_the_context_is_a_400(client: httpx.Client) -> None:
    [model] = client.get("/v1/models").json()["data"]
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "word " * model["max_model_len"]}], "max_tokens": 8})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]


def test_seeded_long_prompt_is_served_and_repeatable(client: httpx.Client) -> None:
    """Regression: a seeded request whose prompt was prefilled in chunks (over 2,048 tokens, vLLM's CPU
    default batch) crashed the CPU engine core ("CPU Generator does not use offset") and with it every
    later call; a harness's 16k-token prompt under a session-fixed seed hit it at once."""
    messages = [{"role": "user", "content": "word " * 6000}]
    first = _chat(client, messages=messages, seed=7, max_tokens=4)
    second = _chat(client, messages=messages, seed=7, max_tokens=4)
    assert len(first["prompt_token_ids"]) > 6000
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert client.get("/health").status_code == 200
