"""The proxy fuzz suite: mutated provider requests against the real proxy app, the stand-in engine and the
real Kafka, and every engine failure mode on every API.

What is generated lives in :mod:`tests.proxy.fuzz_requests`, what is checked in
:mod:`tests.proxy.fuzz_run` (also a CLI for longer campaigns). Here the campaign is bounded for CI
(``ROLLWIRE_FUZZ_EXAMPLES`` generated requests, a fixed Hypothesis seed, no example database) and its
figures are printed as one ``fuzz requests=N status_5xx=N ...`` line.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from tests.support.standin_engine import FAIL_MODES
from tests.proxy.conftest import ProxyUnderTest
from tests.proxy.fuzz_requests import (
    ApiName,
    AuthMode,
    FuzzRequest,
    KeyCarrier,
    large_body_requests,
    minimal_request,
)
from tests.proxy.fuzz_run import (
    Campaign,
    FuzzSession,
    account,
    campaign_sessions,
    error_shape_problem,
    generate,
    read_completions,
    stream_end,
)

pytestmark = pytest.mark.kafka

FUZZ_EXAMPLES = int(os.environ.get("ROLLWIRE_FUZZ_EXAMPLES", "3000"))  # the file: 2-3 minutes on 2 cores
FUZZ_SEED = int(os.environ.get("ROLLWIRE_FUZZ_SEED", "20240611"))
APIS: tuple[ApiName, ...] = ("openai.chat", "openai.responses", "anthropic.messages", "gemini")


async def test_fuzzed_requests_are_answered_in_shape_and_recorded_once(proxy: ProxyUnderTest) -> None:
    sessions = campaign_sessions(proxy.url)
    campaign = Campaign(proxy.url, sessions, concurrency=2)
    await asyncio.to_thread(campaign.run_list, large_body_requests())
    await asyncio.to_thread(campaign.run, lambda sink: generate(FUZZ_EXAMPLES, FUZZ_SEED, sink))
    want = sum(1 for o in campaign.outcomes if o.request.auth.authenticated and o.request.records)
    events, undecodable = await read_completions(proxy.kafka, want)
    report = account(campaign.outcomes, events, sessions, campaign.tag, undecodable)
    print("\n" + report.line() + "\n" + report.status_line())
    assert report.figures["faults"] == 0, "\n".join([report.line(), *report.reproducers()])


# -- the misbehaving engine ---------------------------------------------------------------------------

# mode -> (error kind recorded, streamed calls keep partial tokens, whole calls tried)
ENGINE_MODES: dict[str, tuple[str, bool, bool]] = {
    "error_string": ("engine_error", True, True),
    "error_object": ("engine_error", True, True),
    "no_finish": ("engine_error", True, True),
    "garbage": ("engine_error", True, True),
    "no_token_ids": ("engine_error", False, True),
    "cut": ("engine_error", True, False),
    "error": ("engine_error", False, True),
    "overflow": ("context_overflow", False, True),
}


def test_every_standin_failure_mode_is_exercised() -> None:
    assert set(ENGINE_MODES) | {"hang"} == set(FAIL_MODES)  # hang: test_bad_input's engine-timeout test


def _failed_in_provider_shape(request: FuzzRequest, response: httpx.Response) -> str | None:
    """Why ``response`` is not a provider-shaped failure (None when it is): an HTTP error in the provider's
    error shape, or a 200 stream that ends with the provider's in-stream error and no normal end."""
    if response.status_code >= 400:
        return error_shape_problem(request.error_shape, response.status_code, response.content)
    if response.status_code != 200:
        return f"status {response.status_code}"
    if not request.stream:
        return f"a whole 200 reply: {response.text[:200]}"
    end = stream_end(request, response.content)
    return None if end.kind == "error" else f"stream ended {end.kind} {end.detail}: {response.text[-300:]!r}"


async def _send_engine_mode_calls(proxy: ProxyUnderTest, session: FuzzSession, mode: str, whole: bool
                                  ) -> tuple[list[tuple[FuzzRequest, str]], list[str]]:
    """One call per API (streamed, and whole where the mode has a whole form; Gemini's stream also as a
    JSON array); the calls sent with their user-agent tags, and the problems seen in the answers."""
    variants = [(api, stream, True) for api in APIS for stream in ((True, False) if whole else (True,))]
    variants.append(("gemini", True, False))
    sent: list[tuple[FuzzRequest, str]] = []
    problems: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for api, stream, sse in variants:
            request = minimal_request(api, stream, sse)
            agent = f"engine-mode/{mode}/{api}/{stream}/{'sse' if sse else 'array'}"
            try:
                response = await client.post(
                    f"{proxy.url}/s/{session.session_id}{request.route}", params=dict(request.query),
                    content=request.body, headers={"content-type": "application/json", "user-agent": agent,
                                                   "authorization": f"Bearer {session.api_key}"})
            except httpx.TransportError as exc:
                problems.append(f"{agent}: {type(exc).__name__} {exc}")
                continue
            if (problem := _failed_in_provider_shape(request, response)) is not None:
                problems.append(f"{agent}: HTTP {response.status_code}: {problem}")
            sent.append((request, agent))
    return sent, problems


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
async def test_engine_failure_is_a_provider_error_and_a_failed_call(proxy: ProxyUnderTest, mode: str) -> None:
    kind, partial, whole = ENGINE_MODES[mode]
    created = proxy.new_session(engine={"extra": {"standin_fail": mode}})
    session = FuzzSession(created["session_id"], created["api_key"])
    sent, problems = await _send_engine_mode_calls(proxy, session, mode, whole)
    events = [e for e in (await read_completions(proxy.kafka, len(sent), timeout_s=30, quiet_s=1.0))[0]
              if e.session_id == session.session_id]
    by_agent = {e.agent_hints.get("user-agent"): e for e in events}
    for request, agent in sent:
        event = by_agent.get(agent)
        if event is None:
            problems.append(f"{agent}: no completion event")
            continue
        if event.status != "error" or event.error is None or event.error.kind != kind:
            problems.append(f"{agent}: event status={event.status} error={event.error} (want kind {kind})")
        if partial and request.stream and not (event.token_ids is not None and len(event.token_ids) > 0):
            problems.append(f"{agent}: the partial tokens were not kept")
    assert len(events) == len(sent), f"{len(events)} events for {len(sent)} calls"
    assert not problems, "\n".join(problems)


# -- session isolation, each carrier --------------------------------------------------------------------

@pytest.mark.parametrize("carrier", list(KeyCarrier))
async def test_another_sessions_key_is_refused_and_records_nothing(proxy: ProxyUnderTest,
                                                                   carrier: KeyCarrier) -> None:
    sessions = campaign_sessions(proxy.url)
    refused = (AuthMode.OTHER, AuthMode.NO_KEY, AuthMode.GARBAGE, AuthMode.ANONYMOUS, AuthMode.UNKNOWN_PATH,
               AuthMode.ENDED)
    requests = [FuzzRequest(**{**minimal_request(api, stream).__dict__, "auth": auth, "carrier": carrier})
                for api in APIS for stream in (False, True) for auth in (*refused, AuthMode.OWN, AuthMode.KEY_ONLY)]
    campaign = Campaign(proxy.url, sessions)
    await asyncio.to_thread(campaign.run_list, requests)
    want = sum(1 for r in requests if r.auth.authenticated)
    events, undecodable = await read_completions(proxy.kafka, want, timeout_s=30, quiet_s=1.0)
    report = account(campaign.outcomes, events, sessions, campaign.tag, undecodable)
    assert report.figures["faults"] == 0, "\n".join([report.line(), *report.reproducers()])
    statuses = {(o.request.api, o.request.auth, o.status) for o in campaign.outcomes}
    assert {(api, auth, 401) for api in APIS for auth in refused} <= statuses, sorted(statuses)
    assert {status for _, auth, status in statuses if auth.authenticated} == {200}
