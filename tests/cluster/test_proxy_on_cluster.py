"""The proxy on the three-node cluster: a leader's death is waited out within the capture timeout
and the call ends recorded; with two of three nodes gone no write can be acknowledged, so each call gets
the provider's retryable error and no tokens, and /metrics says how long captures failed."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator

import httpx
import pytest

from deploy.kafka_cluster import KafkaCluster
from tests.support.standin_engine import StandinConfig
from tests.support.standin_engine import create_app as create_standin
from proxy.app import create_app
from schemas.topics import Topic
from schemas.transport import KafkaAdmin, KafkaSettings, TransportError
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def standin_url() -> Iterator[str]:
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16))) as url:
        yield url


async def _leading_most(kafka: KafkaSettings, topic: str, timeout_s: float = 60) -> int:
    """The node leading most of ``topic``'s partitions (a node that has not heard of a new topic yet
    answers UnknownTopicOrPartition: asked again)."""
    deadline = time.monotonic() + timeout_s
    async with KafkaAdmin(kafka.kafka_bootstrap) as admin:
        while True:
            try:
                leaders = collections.Counter(p.leader for p in await admin.partitions(topic))
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
                continue
            return leaders.most_common(1)[0][0]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not on /metrics")


async def test_a_leader_change_is_waited_out_and_a_lost_quorum_is_a_retryable_error(
        restarted: KafkaCluster, cluster_kafka: KafkaSettings, standin_url: str) -> None:
    leader = await _leading_most(cluster_kafka, cluster_kafka.registry().name(Topic.COMPLETIONS))
    with serve(create_app(proxy_settings(standin_url, capture_timeout_s=20.0), cluster_kafka)) as url:
        proxy = ProxyUnderTest(url, cluster_kafka)
        session = proxy.new_session(session_id="cluster-1")
        chat = f"{session['base_urls']['openai']}/chat/completions"
        assert httpx.post(chat, json={"messages": MESSAGES}, timeout=60, headers=auth(session)).status_code == 200

        # The node leading most completions partitions dies: the next calls wait for the new leader.
        await asyncio.to_thread(restarted.kill, leader)
        for stream in (False, True):
            response = httpx.post(chat, json={"messages": MESSAGES, "stream": stream}, timeout=60,
                                  headers=auth(session))
            assert response.status_code == 200, response.text

        # A second node dies: no write can have two replicas, so nothing is acknowledged and nothing served.
        second = next(node for node in (1, 2, 3) if node != leader)
        await asyncio.to_thread(restarted.kill, second)
        failed_at = time.monotonic()
        response = httpx.post(chat, json={"messages": MESSAGES}, timeout=60, headers=auth(session))
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "capture_failed" and "choices" not in response.json()
        assert _metric(url, "rollwire_proxy_capture_failing") == 1.0

        await asyncio.to_thread(restarted.start, 180)
        deadline = time.monotonic() + 120
        while True:
            response = httpx.post(chat, json={"messages": MESSAGES}, timeout=60, headers=auth(session))
            if response.status_code == 200 or time.monotonic() > deadline:
                break
            assert response.status_code == 503 and response.json()["error"]["code"] == "capture_failed"
            await asyncio.sleep(1)
        assert response.status_code == 200, response.text
        assert _metric(url, "rollwire_proxy_capture_failing") == 0.0
        assert _metric(url, "rollwire_proxy_capture_outage_seconds_count") == 1.0
        assert 0 < _metric(url, "rollwire_proxy_capture_outage_seconds_sum") <= time.monotonic() - failed_at
        # Every call that was answered has its completion; the refused ones have none of their tokens served.
        events = await proxy.completions(4)
        ok = [e for e in events if e.status == "ok"]
        assert len(ok) >= 4 and ok[-1].message.content == response.json()["choices"][0]["message"]["content"]
