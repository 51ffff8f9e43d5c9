"""Fixtures for proxy tests: the stand-in engine (recorded vLLM shapes) and a proxy on real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from proxy.app import create_app
from proxy.settings import ProxySettings
from schemas.completions import Completion
from schemas.prompt_chain import resolve_session
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.servers import serve


@pytest.fixture(scope="module")
def standin_url() -> Iterator[str]:
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16))) as url:
        yield url


@dataclass
class ProxyUnderTest:
    url: str
    kafka: KafkaSettings

    admin_token: str | None = None  # sent when the proxy has one (it then guards session creation)
    keys: dict[str, str] = field(default_factory=dict)  # the sessions this helper created: id -> key

    def new_session(self, **body: object) -> dict:
        headers = {"authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        response = httpx.post(f"{self.url}/v1/sessions", json=body, headers=headers, timeout=30)
        assert response.status_code == 201, response.text
        created = response.json()
        self.keys[created["session_id"]] = created["api_key"]
        return created

    def session_state(self, session_id: str, api_key: str | None = None) -> dict:
        """``GET /v1/sessions/{id}``, asked with the session's own key (the proxy tells no one else)."""
        key = api_key or self.keys[session_id]
        response = httpx.get(f"{self.url}/v1/sessions/{session_id}", headers={"authorization": f"Bearer {key}"},
                             timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    async def completions(self, want: int, timeout_s: float = 20.0, *, raw: bool = False) -> list[Completion]:
        """The completion events on this proxy's topic, waiting until ``want`` are there, with their prompts
        resolved (``raw``: as written, prompt deltas left as they are)."""
        got: list[Completion] = []
        async with EventConsumer(self.kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
            async def loop() -> None:
                while len(got) < want:
                    got.extend(r.event for r in await consumer.getmany(timeout_ms=300))
            await asyncio.wait_for(loop(), timeout_s)
            got.extend(r.event for r in await consumer.getmany(timeout_ms=300))
        if not raw:
            chain = resolve_session(got)
            assert not chain.missing, [m.reason for m in chain.missing]
            got = chain.resolved
        return sorted(got, key=lambda e: (e.session_id, e.sequence))


def auth(session: dict) -> dict[str, str]:
    """The header that carries a session's key (every call needs it, also on its /s/{id}/ path)."""
    return {"authorization": f"Bearer {session['api_key']}"}


def proxy_settings(engine_url: str, **overrides: object) -> ProxySettings:
    values = dict(engine_url=engine_url, session_wait_s=0.3, capture_timeout_s=5.0, engine_timeout_s=10.0)
    values.update(overrides)
    return ProxySettings(**values)


@pytest.fixture
def proxy(kafka: KafkaSettings, standin_url: str) -> Iterator[ProxyUnderTest]:
    with serve(create_app(proxy_settings(standin_url), kafka)) as url:
        yield ProxyUnderTest(url, kafka)
