"""The proxy's /metrics says where a call's time went: parse, upstream wait, relay, capture.

A stand-in with a known pace (50 ms to the first token, 16 tokens 5 ms apart) bounds the engine's stages
from below, so that a stage measured in the wrong place (or not at all) shows; each served call is observed
once per stage, a failed call not at all, and the stages of one call fit inside what its client waited.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from proxy.app import create_app
from proxy.stages import STAGES
from schemas.transport import KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

LATENCY_S = 0.05
TOKENS = 16
INTERVAL_S = 0.005
BODY = {"model": "gpt-harness", "messages": [{"role": "user", "content": "List the files."}], "max_tokens": 32}


@pytest.fixture(scope="module")
def paced_standin() -> Iterator[str]:
    config = StandinConfig(latency_ms=LATENCY_S * 1000, reply_tokens=TOKENS, token_interval_ms=INTERVAL_S * 1000)
    with serve(create_standin(config)) as url:
        yield url


@pytest.fixture
def paced_proxy(kafka: KafkaSettings, paced_standin: str) -> Iterator[ProxyUnderTest]:
    with serve(create_app(proxy_settings(paced_standin), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


def stage_series(proxy: ProxyUnderTest, api: str = "openai.chat") -> dict[str, tuple[float, float]]:
    """``{stage: (count, sum_seconds)}`` of the stage histogram on the proxy's /metrics."""
    text = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith("rollwire_proxy_stage_seconds_") or f'api="{api}"' not in line:
            continue
        name, value = line.rsplit(" ", 1)
        stage = name.split('stage="', 1)[1].split('"', 1)[0]
        slot = found.setdefault(stage, [0.0, 0.0])
        if name.startswith("rollwire_proxy_stage_seconds_count"):
            slot[0] = float(value)
        elif name.startswith("rollwire_proxy_stage_seconds_sum"):
            slot[1] = float(value)
    return {stage: (count, total) for stage, (count, total) in found.items()}


def one_call(proxy: ProxyUnderTest, session: dict, *, stream: bool) -> tuple[dict[str, float], float]:
    """Make one call; return its stages' seconds (from the /metrics difference) and what the client waited."""
    before = stage_series(proxy)
    started = time.perf_counter()
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                          json={**BODY, "stream": stream}, timeout=30)
    waited = time.perf_counter() - started
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]")
    after = stage_series(proxy)
    assert set(after) == set(STAGES)
    for stage in STAGES:
        assert after[stage][0] - before.get(stage, (0.0, 0.0))[0] == 1, f"{stage} not observed exactly once"
    return {stage: after[stage][1] - before.get(stage, (0.0, 0.0))[1] for stage in STAGES}, waited


async def test_a_streamed_call_is_split_into_its_four_stages(paced_proxy: ProxyUnderTest) -> None:
    session = paced_proxy.new_session(session_id="stages-stream")
    stages, waited = one_call(paced_proxy, session, stream=True)
    assert all(seconds > 0 for seconds in stages.values()), stages
    # The stand-in's own pace bounds the engine's stages from below: its latency before the first chunk,
    # and the gaps between its token chunks while the proxy relays them. Token n leaves the stand-in
    # n intervals after the first (its own clock), and the relay is timed from the first chunk's arrival,
    # which may be a little later than it left: one gap of the 15 is left as slack for that transit.
    assert stages["upstream_wait"] >= LATENCY_S
    assert stages["relay"] >= (TOKENS - 2) * INTERVAL_S
    # The stages follow each other inside the call, so together they fit in what the client waited.
    assert sum(stages.values()) <= waited
    [event] = await paced_proxy.completions(1)
    assert event.status == "ok"  # capture is the recorded event's write


async def test_a_whole_call_is_split_into_its_four_stages(paced_proxy: ProxyUnderTest) -> None:
    session = paced_proxy.new_session(session_id="stages-whole")
    stages, waited = one_call(paced_proxy, session, stream=False)
    assert all(seconds > 0 for seconds in stages.values()), stages
    assert stages["upstream_wait"] >= LATENCY_S  # the stand-in answers a whole reply after its latency
    assert sum(stages.values()) <= waited


async def test_a_failed_call_is_not_timed_as_served(paced_proxy: ProxyUnderTest) -> None:
    """Only served calls are observed: an engine failure leaves the stage counts as they were."""
    session = paced_proxy.new_session(session_id="stages-failed", engine={"extra": {"standin_fail": "error"}})
    before = stage_series(paced_proxy)
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                          json={**BODY, "stream": True}, timeout=30)
    assert response.status_code >= 500 and response.json()["error"]["message"]
    assert stage_series(paced_proxy) == before
    [event] = await paced_proxy.completions(1)
    assert event.status == "error"
