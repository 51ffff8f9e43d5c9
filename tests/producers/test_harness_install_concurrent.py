"""A fresh harness cache and 8 sessions initializing at once through the real gateway node and the real
Qwen Code CLI from npm: npm runs once, and every session completes.

The regression: each session's init installed the CLI into the same prefix at the same time (a marker
file, no lock), so npm failed with ENOTEMPTY in some and others started a half-installed CLI (``Cannot
find module``), which was then blamed on the policy. The cache is empty on every run: the directory named
by ``ROLLWIRE_TEST_FRESH_HARNESS_CACHE`` (``.ci/run`` makes a new one each run) or the test's own
temporary one, so a warm cache can never hide the first install.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from producers.gateway.settings import GatewaySettings
from schemas.sessions import SessionSpec, SessionStatus
from schemas.tasks import AgentSpec
from schemas.transport import KafkaSettings
from tests.harnesses.common import serve_standin_proxy
from tests.producers.gateway_nodes import Lifecycle, publish, running_node
from tests.proxy.conftest import ProxyUnderTest

SESSIONS = 8


@pytest.fixture
def proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


@pytest.fixture
def counted_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real npm behind a shim that appends each command line to a file; an empty harness cache."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    runs = tmp_path / "npm-runs.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "npm"
    shim.write_text(f'#!/bin/sh\necho "$*" >> {runs}\nexec {npm} "$@"\n')
    shim.chmod(0o755)
    cache = Path(os.environ.get("ROLLWIRE_TEST_FRESH_HARNESS_CACHE") or tmp_path / "cache") / uuid.uuid4().hex[:8]
    cache.mkdir(parents=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ROLLWIRE_CACHE_DIR", str(cache))
    return runs


async def test_eight_sessions_on_a_cold_cache_install_qwen_code_once_and_all_complete(
        kafka: KafkaSettings, proxy: ProxyUnderTest, counted_npm: Path, tmp_path: Path) -> None:
    specs = [SessionSpec(session_id=f"cold-{uuid.uuid4().hex[:10]}", task_id="cold-cache", sample_index=i,
                         instruction="Say hello.", timeout_s=600, api_key=f"key-{uuid.uuid4().hex}",
                         agent=AgentSpec(harness="qwen-code", model="qwen3-coder"))
             for i in range(SESSIONS)]
    settings = GatewaySettings(proxy_url=proxy.url, port=0, run_slots=SESSIONS, prewarm=0, init_workers=SESSIONS,
                               recheck_s=0.5, node_name=f"node-{uuid.uuid4().hex[:6]}")
    async with Lifecycle(kafka) as lifecycle, running_node(settings, kafka, tmp_path / "sessions"):
        await publish(kafka, *specs)
        ends = await lifecycle.ended(*(s.session_id for s in specs), timeout_s=540)
    installs = [line for line in counted_npm.read_text().splitlines() if line.startswith("install")]
    assert len(installs) == 1, installs
    for spec in specs:
        end = ends[spec.session_id]
        assert end.status is SessionStatus.COMPLETED and end.failure is None, end
