"""Real harness CLIs from npm (Qwen Code, Pi) complete a session through the proxy against the real
vLLM CPU server, and every call they made is on the completions topic with token ids."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from producers.harness_install import ensure_harness
from tests.harnesses.common import assert_exit_ok, clean_env, fresh_topics, serve_proxy, session_events
from tests.proxy.conftest import ProxyUnderTest

pytestmark = pytest.mark.kafka

# The session fixes max_tokens: a random model rarely ends a turn by itself, and harnesses ask for tens
# of thousands of output tokens.
SESSION = {"engine": {"max_tokens": 24, "seed": 3}}


@pytest.fixture(scope="module")
def harness_proxy(kafka_bootstrap: str, vllm_url: str) -> Iterator[ProxyUnderTest]:
    kafka = asyncio.run(fresh_topics(kafka_bootstrap, "harness"))
    with serve_proxy(vllm_url, kafka, engine_timeout_s=300) as proxy:
        yield proxy


def _run(command: list[str], home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=home, env={**clean_env(), "HOME": str(home), **env}, capture_output=True,
                          text=True, timeout=600)


async def test_qwen_code_session_is_recorded(harness_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    qwen = ensure_harness("qwen-code")
    session = harness_proxy.new_session(**SESSION)
    (tmp_path / ".qwen").mkdir()
    (tmp_path / ".qwen" / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}}, "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False}, "general": {"enableAutoUpdate": False},
        "memory": {"enableManagedAutoMemory": False}, "model": {"name": "qwen3-coder"}}))
    result = _run([str(qwen), "--yolo", "-o", "json", "list the files here"], tmp_path,
                  {"OPENAI_BASE_URL": session["base_urls"]["openai"], "OPENAI_API_KEY": session["api_key"],
                   "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"})
    assert_exit_ok(result)
    assert "API Error" not in result.stdout
    await session_events(harness_proxy, session["session_id"], "openai.chat")


async def test_pi_session_is_recorded(harness_proxy: ProxyUnderTest, tmp_path: Path) -> None:
    pi = ensure_harness("pi")
    session = harness_proxy.new_session(**SESSION)
    (tmp_path / ".pi" / "agent").mkdir(parents=True)
    (tmp_path / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"rollwire": {
        "baseUrl": session["base_urls"]["openai"], "api": "openai-completions", "apiKey": session["api_key"],
        "models": [{"id": "qwen3-coder", "reasoning": False, "contextWindow": 32768, "maxTokens": 4096}]}}}))
    result = _run([str(pi), "-p", "--provider", "rollwire", "--model", "qwen3-coder", "--no-session",
                   "list the files here"], tmp_path,
                  {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"})
    assert_exit_ok(result)
    await session_events(harness_proxy, session["session_id"], "openai.chat")
