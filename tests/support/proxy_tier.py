"""A proxy tier for tests: two real ``rollwire proxy`` processes behind the real HAProxy, brought up by the
routine behind ``rollwire up --proxies 2``; and a session's completion events read back from the log."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import stack
from deploy.settings import ProxyTierSettings
from schemas.completions import Completion
from schemas.prompt_chain import resolve_session
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.servers import free_port


@contextlib.contextmanager
def proxy_tier(kafka: KafkaSettings, engine_url: str, home: Path, monkeypatch: pytest.MonkeyPatch, *,
               env: dict[str, str] | None = None, timeout_s: float = 120) -> Iterator[stack.ProxyTier]:
    """Two proxy processes and their front over ``engine_url``, the tier's home ``home``; stopped afterwards."""
    assert shutil.which("haproxy") is not None, "haproxy is not installed: apt-get install -y haproxy"
    monkeypatch.setenv("ROLLWIRE_HOME", str(home))
    monkeypatch.delenv("ROLLWIRE_PROXY_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("ROLLWIRE_PROXY_PUBLIC_URL", raising=False)
    port = free_port()
    monkeypatch.setenv("ROLLWIRE_PROXY_PORT", str(port))
    settings = ProxyTierSettings(count=2, tier_port=stack.free_port_run(2), stats_port=free_port())
    tier = stack.proxy_tier(kafka, engine_url, stack.Port("127.0.0.1", port), settings, timeout_s=timeout_s,
                            env={"ROLLWIRE_SESSION_WAIT_S": "5", **(env or {})})
    try:
        yield tier
    finally:
        for part in reversed(tier.parts):
            if part.stop is not None:
                part.stop()


async def session_events(kafka: KafkaSettings, session_id: str) -> list[Completion]:
    """The session's completion events on the log now, prompts resolved, by number."""
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        ends = await consumer.end_offsets(await consumer.wait_for_assignment())
        events: list[Completion] = []
        while not await consumer.caught_up(ends):
            events += [r.event for r in await consumer.getmany(timeout_ms=300)
                       if isinstance(r.event, Completion) and r.event.session_id == session_id]
    chain = resolve_session(events)
    assert not chain.missing, [m.reason for m in chain.missing]
    return sorted(chain.resolved, key=lambda e: e.sequence)
