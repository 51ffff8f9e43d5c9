"""A proxy process SIGKILLed with a call in flight: the harness sees a broken connection, its retry reaches the
other process through the front, which reads the session's branch back from the log and serves the call
exactly. One event per answered call, none twice; the dead call, never answered, has none.

Real ``rollwire proxy`` processes behind the real HAProxy (the tier of ``up --proxies 2``) over the stand-in
engine with vLLM's token endpoints, its replies streamed slowly enough to be cut.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy import proxy_front, stack
from schemas.transport import KafkaSettings
from tests.deploy.test_proxy_front import _new_session, tier_kafka  # noqa: F401  (fixture)
from tests.servers import serve
from tests.support.proxy_tier import proxy_tier, session_events
from tests.support.standin_engine import StandinConfig, create_app as create_standin

pytestmark = pytest.mark.kafka

TOKENS, TOKEN_MS = 40, 50  # two seconds a reply: the kill lands inside it


@pytest.fixture
def slow_engine() -> Iterator[str]:
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=TOKENS, token_interval_ms=TOKEN_MS,
                                            token_api=True))) as url:
        yield url


@pytest.fixture
def tier(tier_kafka: KafkaSettings, slow_engine: str, tmp_path: Path,  # noqa: F811
         monkeypatch: pytest.MonkeyPatch) -> Iterator[stack.ProxyTier]:
    with proxy_tier(tier_kafka, slow_engine, tmp_path / "home", monkeypatch, timeout_s=90) as tier:
        yield tier


def _chat(url: str, session: dict, messages: list[dict], *, stream: bool) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"authorization": f"Bearer {session['api_key']}"},
                      json={"model": "m", "messages": messages, "stream": stream, "max_tokens": TOKENS})


def _text(response: httpx.Response) -> str:
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_call_cut_by_a_killed_process_is_retried_on_the_other_and_continues_exactly(
        tier: stack.ProxyTier, tier_kafka: KafkaSettings) -> None:  # noqa: F811
    front = tier.entry.address
    session = _new_session(front, "tier-inflight")
    messages: list[dict] = [{"role": "system", "content": "terse"}, {"role": "user", "content": "first"}]
    first = _chat(front, session, messages, stream=False)
    assert first.status_code == 200, first.text
    victim = first.headers[proxy_front.SERVED_BY_HEADER]
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "second"}]
    _, members = stack.tier_services()
    pid = next(m for m in members if m.name == victim).pid()
    assert pid is not None

    def kill_soon() -> None:
        time.sleep(TOKENS * TOKEN_MS / 1000 / 3)  # a third of the way into the reply
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    with pytest.raises(httpx.HTTPError):  # the harness's side of the kill: the stream breaks
        cut = _chat(front, session, messages, stream=True)
        cut.raise_for_status()
        assert cut.text.rstrip().endswith("[DONE]"), "the stream was not cut"
    killer.join()
    retried = _chat(front, session, messages, stream=True)  # the SDK's retry, as it would send it
    assert retried.status_code == 200, retried.text
    assert retried.headers[proxy_front.SERVED_BY_HEADER] != victim
    assert _text(retried)

    events = asyncio.run(session_events(tier_kafka, session["session_id"]))
    served = [e for e in events if e.status == "ok"]
    assert [e.proxy for e in served] == [victim, retried.headers[proxy_front.SERVED_BY_HEADER]]
    assert len(events) == 2, [(e.sequence, e.status, e.proxy) for e in events]  # the cut call left none
    parent, child = served
    assert child.sequence == 2  # number 1 went to the cut call: numbers stay unique, never reused
    assert child.continuation.mode == "exact" and child.continuation.parent_sequence == parent.sequence
    whole = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()
    assert child.prompt_token_ids.tolist()[:len(whole)] == whole
    assert child.continuation.restore is not None and child.continuation.restore.replayed == 1
