"""Durable capture: no reply without the broker's ack, recovery when Kafka returns, sessions from Kafka,
and the bookkeeping of a harness that hangs up mid-stream."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from deploy.kafka import KafkaBroker, KafkaConfig
from proxy.app import create_app
from schemas.sessions import SessionSpec
from schemas.tasks import EngineParams
from schemas.transport.admin import ensure_topics
from schemas.transport import EventProducer, KafkaSettings
from schemas.topics import Topic
from tests.kafka_batches import stored_codecs
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import free_port, serve

pytestmark = pytest.mark.kafka

MESSAGES = [{"role": "user", "content": "hi"}]


def _metric(url: str, name: str) -> float:
    """One unlabelled sample of the proxy's /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not on /metrics")


async def test_kafka_outage_withholds_replies_and_recovers(tmp_path: Path, standin_url: str) -> None:
    base = KafkaConfig.from_env()
    config = KafkaConfig(cache_dir=base.cache_dir, home=tmp_path / "kafka", port=free_port(),
                         controller_port=free_port())
    broker = KafkaBroker(config)
    broker.start(timeout_s=180)
    kafka = KafkaSettings(kafka_bootstrap=config.bootstrap, topic_prefix="outage.", session_partitions=2,
                          task_partitions=1, kafka_request_timeout_ms=3000)
    await ensure_topics(kafka)
    try:
        with serve(create_app(proxy_settings(standin_url, capture_timeout_s=3.0), kafka)) as url:
            proxy = ProxyUnderTest(url, kafka)
            session = proxy.new_session(session_id="outage-1")
            chat = f"{session['base_urls']['openai']}/chat/completions"
            assert httpx.post(chat, json={"messages": MESSAGES}, timeout=30, headers=auth(session)).status_code == 200

            assert _metric(url, "rollwire_proxy_capture_failing") == 0.0
            broker.stop()
            failed_at = time.monotonic()
            for stream in (False, True):
                response = httpx.post(chat, json={"messages": MESSAGES, "stream": stream}, timeout=30,
                                      headers=auth(session))
                assert response.status_code == 503, response.text  # retryable, and no tokens served
                assert response.json()["error"]["code"] == "capture_failed"
                assert "choices" not in response.json()
            # The outage is on /metrics while it lasts ...
            assert _metric(url, "rollwire_proxy_capture_failing") == 1.0
            assert _metric(url, "rollwire_proxy_capture_outage_seconds_count") == 0.0

            broker.start(timeout_s=180)
            deadline = time.monotonic() + 60
            while True:
                response = httpx.post(chat, json={"messages": MESSAGES}, timeout=30, headers=auth(session))
                if response.status_code == 200 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1)
            assert response.status_code == 200, response.text
            recovered_at = time.monotonic()
            # ... and its length once it is over: from the first failed capture to the first good one.
            assert _metric(url, "rollwire_proxy_capture_failing") == 0.0
            assert _metric(url, "rollwire_proxy_capture_outage_seconds_count") == 1.0
            outage = _metric(url, "rollwire_proxy_capture_outage_seconds_sum")
            assert 0 < outage <= recovered_at - failed_at, (outage, recovered_at - failed_at)
            events = await proxy.completions(2)
            ok = [e for e in events if e.status == "ok"]
            assert len(ok) >= 2 and ok[-1].message.content == response.json()["choices"][0]["message"]["content"]
    finally:
        broker.stop()


async def test_sessions_registered_on_kafka_are_served(proxy: ProxyUnderTest) -> None:
    """The proxy's registry is the sessions topic: a spec written by another service (a rollout server)
    makes its key usable, with the spec's fixed sampling parameters."""
    spec = SessionSpec(session_id="from-kafka", task_id="task-9", api_key="key-from-kafka-123",
                       engine=EngineParams(max_tokens=5), policy_version="v7")
    async with EventProducer(proxy.kafka) as producer:
        await producer.send(spec)
    deadline = time.monotonic() + 20
    while True:
        response = httpx.post(f"{proxy.url}/v1/chat/completions", json={"messages": MESSAGES},
                              headers={"x-api-key": "key-from-kafka-123"}, timeout=30)
        if response.status_code != 401 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    assert response.status_code == 200, response.text
    [event] = await proxy.completions(1)
    # The completion's version is the engine's (this stand-in reports none), never the session's claim.
    assert (event.session_id, event.task_id, event.policy_version) == ("from-kafka", "task-9", None)
    assert len(event.token_ids) <= 5 and event.request.sampling.max_tokens == 5


async def test_client_hanging_up_mid_stream_is_recorded(kafka: KafkaSettings, standin_url: str) -> None:
    from tests.support.standin_engine import StandinConfig, create_app as create_standin

    slow = create_standin(StandinConfig(latency_ms=1, reply_tokens=40, token_interval_ms=50))
    with serve(slow) as slow_url, serve(create_app(proxy_settings(slow_url), kafka)) as url:
        proxy = ProxyUnderTest(url, kafka)
        session = proxy.new_session()
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{session['base_urls']['openai']}/chat/completions",
                                     json={"messages": MESSAGES, "stream": True},
                                     headers=auth(session)) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first token arrived: hang up
        [event] = await proxy.completions(1)
        assert event.status == "error" and event.error.kind == "client_disconnected"
        assert event.prompt_token_ids is not None


async def test_captured_events_are_compressed_by_the_broker(proxy: ProxyUnderTest) -> None:
    """On the registry's topics (compression.type=zstd) ``capture_compression=auto`` leaves compression to
    the broker: the proxy sends its events as they are, and the log holds them compressed."""
    session = proxy.new_session(session_id="compressed-1")
    chat = f"{session['base_urls']['openai']}/chat/completions"
    trace = "Traceback (most recent call last):\n" + '  File "app/models.py", line 10, in save\n' * 300
    response = httpx.post(chat, json={"messages": [{"role": "user", "content": trace}]}, headers=auth(session),
                          timeout=30)
    assert response.status_code == 200, response.text
    [event] = await proxy.completions(1)
    assert event.session_id == "compressed-1"
    assert _metric(proxy.url, 'rollwire_proxy_capture_compression{by="broker"}') == 1.0
    assert _metric(proxy.url, 'rollwire_proxy_capture_compression{by="producer"}') == 0.0
    stored = await stored_codecs(proxy.kafka.kafka_bootstrap, proxy.kafka.registry().name(Topic.COMPLETIONS),
                                 proxy.kafka.session_partitions)
    assert stored and set(stored) == {"zstd"}, stored
