"""Real harness CLIs from npm (Qwen Code, Pi) complete a session through the proxy against the real
vLLM CPU server, and every call they made is on the completions topic with token ids."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from producers.harness_install import ensure_harness
from proxy.app import create_app
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

# The session fixes max_tokens: a random model rarely ends a turn by itself, and harnesses ask for tens
# of thousands of output tokens.
SESSION = {"engine": {"max_tokens": 24, "seed": 3}}


@pytest.fixture(scope="module")
def harness_proxy(kafka_bootstrap: str, vllm_url: str) -> Iterator[ProxyUnderTest]:
    kafka = KafkaSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=f"harness{uuid.uuid4().hex[:6]}.", session_partitions=4,
                          task_partitions=2)
    import asyncio

    from deploy.kafka import ensure_topics
    asyncio.run(ensure_topics(kafka_bootstrap, kafka.registry()))
    with serve(create_app(proxy_settings(vllm_url, engine_timeout_s=300), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


def _run(command: list[str], home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "ROLLWIRE_"))}
    return subprocess.run(command, cwd=home, env={**base, "HOME": str(home), **env}, capture_output=True,
                          text=True, timeout=600)


async def _assert_all_calls_recorded(proxy: ProxyUnderTest, session_id: str) -> None:
    calls = httpx.get(f"{proxy.url}/v1/sessions/{session_id}").json()["calls"]
    assert calls >= 1
    events = [e for e in await proxy.completions(calls) if e.session_id == session_id]
    assert sorted(e.sequence for e in events) == list(range(calls))
    for event in events:
        assert event.status == "ok", event.error
        assert event.api == "openai.chat"
        assert len(event.prompt_token_ids) > 100 and len(event.token_ids) > 0
        assert len(event.logprobs) == len(event.token_ids)


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
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "API Error" not in result.stdout
    await _assert_all_calls_recorded(harness_proxy, session["session_id"])


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
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    await _assert_all_calls_recorded(harness_proxy, session["session_id"])
