"""A fuzz campaign against a live gateway proxy: send generated requests, judge every answer, account
for every completion event, and report figures and minimal reproducers.

This module owns what the fuzz suite checks, for the CI test (``tests/proxy/test_fuzz.py``) and for
longer campaigns from the command line:

- per request (:func:`judge`): no 5xx (the stand-in engine is healthy), no hang (a per-request timeout),
  no connection reset; an unauthenticated call on a model route gets a 401; every error body is in the
  provider's shape for its path (OpenAI on ``/v1/chat/completions``, ``/v1/responses`` and other ``/v1/``
  paths, Anthropic on ``/v1/messages``, Gemini on ``/v1beta/``), unknown paths and methods included; every
  200 parses in the provider's shape, and a stream ends with the provider's proper end (``[DONE]``,
  ``response.completed``/``incomplete``, ``message_stop``, a candidate with a ``finishReason``);
- after the run (:func:`account`): every session's events have sequences 0..n-1, one event per
  authenticated model call (refused ones too), none for a call without the right key, and no call is
  recorded under a session other than its key's. Events are matched to requests by the ``user-agent``
  each request carries (a tag with its index), which the proxy keeps in the event's agent hints.

    python -m tests.proxy.fuzz_run --requests 5000 [--seed 1] [--concurrency 4]

prints ``name=value`` figures, ``faults`` last, and one reproducer per kind of fault found.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import sys
import threading
import time
import uuid
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis.errors import HypothesisDeprecationWarning

from schemas.completions import Completion
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.proxy.fuzz_requests import AuthMode, ErrorShape, FuzzRequest, KeyCarrier, fuzz_requests

REQUEST_TIMEOUT_S = 30.0
ENDED_SESSION = 2  # index of the ended session in :func:`campaign_sessions`
_TAG = "rollwire-fuzz"


# -- sessions and sending -----------------------------------------------------------------------------

@dataclass(frozen=True)
class FuzzSession:
    """A session the campaign calls on: its id and its API key."""

    session_id: str
    api_key: str


def create_sessions(proxy_url: str, count: int = 2, **body: Any) -> list[FuzzSession]:
    """``count`` ad-hoc sessions registered through ``POST /v1/sessions``."""
    sessions = []
    for _ in range(count):
        response = httpx.post(f"{proxy_url}/v1/sessions", json=body, timeout=30)
        response.raise_for_status()
        created = response.json()
        sessions.append(FuzzSession(created["session_id"], created["api_key"]))
    return sessions


def campaign_sessions(proxy_url: str) -> list[FuzzSession]:
    """The sessions a campaign uses: two live ones (indexes 0 and 1) and an ended one (index 2,
    :attr:`AuthMode.ENDED`)."""
    sessions = create_sessions(proxy_url, 3)
    ended = httpx.post(f"{proxy_url}/v1/sessions/{sessions[2].session_id}/end", json={}, timeout=30,
                       headers={"authorization": f"Bearer {sessions[2].api_key}"})
    ended.raise_for_status()
    return sessions


@dataclass
class Outcome:
    """What one request got: status (or the exception), the faults judged, and what it asked."""

    index: int
    request: FuzzRequest
    status: int | None = None
    exception: str | None = None
    faults: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    body_excerpt: str = ""

    @property
    def session_of_key(self) -> int | None:
        """The index of the session the request's key belongs to (None: no key, or one nobody has)."""
        auth = self.request.auth
        if auth in (AuthMode.OWN, AuthMode.KEY_ONLY):
            return self.request.session
        if auth == AuthMode.OTHER:
            return 1 - self.request.session
        if auth == AuthMode.UNKNOWN_PATH:
            return self.request.session
        if auth == AuthMode.ENDED:
            return ENDED_SESSION
        return None


def _target(request: FuzzRequest, sessions: list[FuzzSession], base_url: str
            ) -> tuple[str, dict[str, str], dict[str, str | bytes]]:
    """URL, query parameters and headers for ``request`` as its auth mode says."""
    own = sessions[ENDED_SESSION if request.auth == AuthMode.ENDED else request.session]
    key: str | None
    if request.auth in (AuthMode.OWN, AuthMode.KEY_ONLY, AuthMode.UNKNOWN_PATH, AuthMode.ENDED):
        key = own.api_key
    elif request.auth == AuthMode.OTHER:
        key = sessions[1 - request.session].api_key
    elif request.auth == AuthMode.NO_KEY:
        key = None
    else:
        key = f"rw-not-a-key-{uuid.uuid4().hex[:12]}"
    prefix = f"/s/{own.session_id}" if request.auth.on_session_path else ""
    if request.auth == AuthMode.UNKNOWN_PATH:
        prefix = f"/s/nosuch-{uuid.uuid4().hex[:8]}"
    params = dict(request.query)
    headers: dict[str, str | bytes] = dict(request.headers)
    if request.content_type is not None:
        headers["content-type"] = request.content_type
    if key is not None:
        if request.carrier == KeyCarrier.BEARER:
            headers["authorization"] = f"Bearer {key}"
        elif request.carrier == KeyCarrier.QUERY:
            params["key"] = key
        else:
            headers[str(request.carrier)] = key
    return f"{base_url}{prefix}{request.route}", params, headers


def _chunks(body: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


def send(client: httpx.Client, base_url: str, sessions: list[FuzzSession], index: int, tag: str,
         request: FuzzRequest) -> Outcome:
    """Send one request and judge the answer."""
    url, params, headers = _target(request, sessions, base_url)
    headers["user-agent"] = f"{_TAG}/{tag}/{index}"
    outcome = Outcome(index, request)
    started = time.perf_counter()
    content: bytes | Iterator[bytes] = _chunks(request.body) if request.chunked else request.body
    try:
        if request.disconnect:
            with client.stream(request.method, url, params=params, headers=headers, content=content) as response:
                outcome.status = response.status_code
                outcome.body_excerpt = next(response.iter_bytes(), b"")[:300].decode("utf-8", errors="replace")
            # Closed with the reply unread: what the harness got is not judged, only that the call is
            # recorded once (the proxy may or may not have finished it).
            if response.status_code >= 500:
                outcome.faults.append(f"status_5xx:{response.status_code}")
            outcome.elapsed_s = time.perf_counter() - started
            return outcome
        response = client.request(request.method, url, params=params, headers=headers, content=content)
    except httpx.TimeoutException as exc:
        outcome.exception = f"hang: {type(exc).__name__}"
        outcome.faults.append("hang")
    except httpx.TransportError as exc:
        outcome.exception = f"{type(exc).__name__}: {exc}"
        outcome.faults.append("connection_reset")
    else:
        outcome.status = response.status_code
        outcome.body_excerpt = response.text[:300]
        outcome.faults.extend(judge(request, response.status_code, response.headers.get("content-type", ""),
                                    response.content))
    outcome.elapsed_s = time.perf_counter() - started
    return outcome


# -- judging one answer -------------------------------------------------------------------------------

def error_shape_problem(shape: ErrorShape, status: int, body: bytes) -> str | None:
    """Why ``body`` is not the provider's error object (None when it is)."""
    try:
        document = json.loads(body)
    except ValueError:
        return f"error body is not JSON: {body[:120]!r}"
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return f"no error object: {body[:160]!r}"
    message = error.get("message")
    if not isinstance(message, str) or not message or "Traceback" in message:
        return f"error message missing or a traceback: {body[:160]!r}"
    if shape == "openai":
        if not {"message", "type", "param", "code"} <= set(error) or not isinstance(error["type"], str):
            return f"not OpenAI's error object {{message, type, param, code}}: {body[:160]!r}"
    elif shape == "anthropic":
        if document.get("type") != "error" or not isinstance(error.get("type"), str):
            return f"not Anthropic's {{type: error, error: {{type, message}}}}: {body[:160]!r}"
    elif error.get("code") != status or not isinstance(error.get("status"), str):
        return f"not Gemini's {{error: {{code={status}, message, status}}}}: {body[:160]!r}"
    return None


@dataclass
class SseEvent:
    name: str | None
    data: str


def parse_sse(body: bytes) -> list[SseEvent]:
    """Server-sent events (``event:`` and ``data:`` lines, blank-line separated; LF or CRLF)."""
    events = []
    text = body.decode("utf-8", errors="replace").replace("\r\n", "\n")
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if name is not None or data:
            events.append(SseEvent(name, "\n".join(data)))
    return events


@dataclass(frozen=True)
class StreamEnd:
    """How a reply ended: ``normal`` (the provider's proper end), ``error`` (an in-band error), ``bad``."""

    kind: str
    detail: str = ""


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def chat_stream_end(body: bytes) -> StreamEnd:
    events = parse_sse(body)
    datas = [e.data for e in events]
    if not datas:
        return StreamEnd("bad", "empty stream")
    chunks = [_json(d) for d in datas if d != "[DONE]"]
    if any(isinstance(c, dict) and "error" in c for c in chunks):
        if "[DONE]" in datas or any(_chat_finish(c) for c in chunks):
            return StreamEnd("bad", "an error chunk and a normal end in one stream")
        return StreamEnd("error")
    if datas[-1] != "[DONE]":
        return StreamEnd("bad", f"does not end with [DONE]: {datas[-1][:120]!r}")
    if any(not isinstance(c, dict) for c in chunks):
        return StreamEnd("bad", "a chunk is not a JSON object")
    if not any(_chat_finish(c) for c in chunks):
        return StreamEnd("bad", "[DONE] without a chunk carrying finish_reason")
    return StreamEnd("normal")


def _chat_finish(chunk: Any) -> bool:
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    return bool(choices) and isinstance(choices[0], dict) and bool(choices[0].get("finish_reason"))


def responses_stream_end(body: bytes) -> StreamEnd:
    events = parse_sse(body)
    names = [e.name or (_json(e.data) or {}).get("type") for e in events]
    if not names:
        return StreamEnd("bad", "empty stream")
    if "error" in names or "response.failed" in names:
        if "response.completed" in names or "response.incomplete" in names:
            return StreamEnd("bad", "an error and a normal end in one stream")
        return StreamEnd("error")
    if names[0] != "response.created":
        return StreamEnd("bad", f"first event is {names[0]!r}, not response.created")
    if names[-1] not in ("response.completed", "response.incomplete"):
        return StreamEnd("bad", f"last event is {names[-1]!r}")
    final = _json(events[-1].data)
    if not isinstance(final, dict) or not isinstance(final.get("response"), dict):
        return StreamEnd("bad", "the final event carries no response object")
    return StreamEnd("normal")


def messages_stream_end(body: bytes) -> StreamEnd:
    events = parse_sse(body)
    names = [e.name for e in events]
    if not names:
        return StreamEnd("bad", "empty stream")
    if "error" in names:
        if "message_stop" in names:
            return StreamEnd("bad", "an error and message_stop in one stream")
        error = _json(events[names.index("error")].data)
        if not (isinstance(error, dict) and error.get("type") == "error" and isinstance(error.get("error"), dict)):
            return StreamEnd("bad", f"error event not in Anthropic's shape: {events[names.index('error')].data[:120]}")
        return StreamEnd("error")
    if names[0] != "message_start" or names[-1] != "message_stop":
        return StreamEnd("bad", f"events run {names[0]!r} .. {names[-1]!r}, not message_start .. message_stop")
    deltas = [_json(e.data) for e in events if e.name == "message_delta"]
    if not any(isinstance(d, dict) and (d.get("delta") or {}).get("stop_reason") for d in deltas):
        return StreamEnd("bad", "no message_delta with a stop_reason")
    return StreamEnd("normal")


def gemini_stream_end(body: bytes, sse: bool) -> StreamEnd:
    if sse:
        # A failed stream ends as Google ends one: its bare error object on the last line, no ``data:``.
        head, _, last = body.rstrip(b"\n").rpartition(b"\n")
        failed = _json(last.decode("utf-8", errors="replace")) if last.startswith(b"{") else None
        if isinstance(failed, dict) and isinstance(failed.get("error"), dict):
            documents = [_json(e.data) for e in parse_sse(head)]
            if any(isinstance(d, dict) and _gemini_finish(d) for d in documents):
                return StreamEnd("bad", "an error and a finishReason in one stream")
            return StreamEnd("error")
        documents = [_json(e.data) for e in parse_sse(body)]
    else:
        documents = _json(body.decode("utf-8", errors="replace"))
        if not isinstance(documents, list):
            return StreamEnd("bad", f"not a JSON array stream: {body[:120]!r}")
    if not documents:
        return StreamEnd("bad", "empty stream")
    if any(not isinstance(d, dict) for d in documents):
        return StreamEnd("bad", "a chunk is not a JSON object")
    if any("error" in d for d in documents):
        if any(_gemini_finish(d) for d in documents):
            return StreamEnd("bad", "an error and a finishReason in one stream")
        return StreamEnd("error")
    if not _gemini_finish(documents[-1]):
        return StreamEnd("bad", "the last chunk has no candidate with a finishReason")
    return StreamEnd("normal")


def _gemini_finish(document: dict[str, Any]) -> bool:
    candidates = document.get("candidates")
    return bool(candidates) and isinstance(candidates[0], dict) and bool(candidates[0].get("finishReason"))


def whole_reply_problem(api: str, body: bytes) -> str | None:
    """Why a whole (non-streamed) 200 body is not the provider's reply (None when it is)."""
    document = _json(body.decode("utf-8", errors="replace"))
    if not isinstance(document, dict):
        return f"reply is not a JSON object: {body[:120]!r}"
    if api == "openai.chat":
        choices = document.get("choices")
        ok = (document.get("object") == "chat.completion" and isinstance(choices, list) and choices
              and isinstance(choices[0].get("message"), dict) and choices[0].get("finish_reason"))
    elif api == "openai.responses":
        ok = (document.get("object") == "response" and document.get("status") in ("completed", "incomplete")
              and isinstance(document.get("output"), list))
    elif api == "anthropic.messages":
        ok = (document.get("type") == "message" and document.get("role") == "assistant"
              and isinstance(document.get("content"), list) and isinstance(document.get("stop_reason"), str))
    else:
        candidates = document.get("candidates")
        ok = (isinstance(candidates, list) and candidates and isinstance(candidates[0].get("content"), dict)
              and _gemini_finish(document))
    return None if ok else f"not a {api} reply: {body[:160]!r}"


def stream_end(request: FuzzRequest, body: bytes) -> StreamEnd:
    """How a streamed reply to ``request`` ended, by its provider's rules."""
    if request.api == "openai.chat":
        return chat_stream_end(body)
    if request.api == "openai.responses":
        return responses_stream_end(body)
    if request.api == "anthropic.messages":
        return messages_stream_end(body)
    return gemini_stream_end(body, sse=("alt", "sse") in request.query)


def is_streamed(request: FuzzRequest, content_type: str) -> bool:
    if request.api == "gemini":
        return ":streamGenerateContent" in request.route
    return content_type.startswith("text/event-stream")


def judge(request: FuzzRequest, status: int, content_type: str, body: bytes) -> list[str]:
    """The faults in one answer (empty when it is right)."""
    faults = []
    if status >= 500:
        faults.append(f"status_5xx:{status}")
    if not request.auth.authenticated:
        allowed = {401} if request.records else {401, 404, 405, 426}
        if status not in allowed:
            faults.append(f"auth:unauthenticated got {status}")
    elif status == 401:
        faults.append("auth:the session's own key refused")
    if status >= 400:
        problem = error_shape_problem(request.error_shape, status, body)
        if problem:
            faults.append(f"unshaped_error:{problem}")
    elif status == 200:
        if not request.records:
            faults.append("bad_reply:200 on a path that is no model call")
        elif is_streamed(request, content_type):
            if request.stream is False and request.api != "gemini":
                faults.append("bad_reply:streamed though the request asked for a whole reply")
            end = stream_end(request, body)
            if end.kind != "normal":
                faults.append(f"bad_reply:stream ended {end.kind}: {end.detail}")
        else:
            if request.stream is True:
                faults.append("bad_reply:whole reply though the request asked for a stream")
            problem = whole_reply_problem(request.api, body)
            if problem:
                faults.append(f"bad_reply:{problem}")
    else:
        faults.append(f"bad_reply:unexpected status {status}")
    return faults


# -- running ------------------------------------------------------------------------------------------

def generate(count: int, seed: int, sink: Callable[[FuzzRequest], None]) -> None:
    """Draw ``count`` requests from :func:`fuzz_requests` (reproducibly for a seed) into ``sink``."""

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_requests())
    def draw(request: FuzzRequest) -> None:
        sink(request)

    with warnings.catch_warnings():
        # The proxy under test runs in this process and uses ``random`` while Hypothesis draws: not ours.
        warnings.filterwarnings("ignore", category=HypothesisDeprecationWarning)
        draw()


@dataclass
class Campaign:
    """Sends requests to one proxy with a pool of threads and keeps every outcome."""

    base_url: str
    sessions: list[FuzzSession]
    concurrency: int = 1
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    outcomes: list[Outcome] = field(default_factory=list)

    def run(self, produce: Callable[[Callable[[FuzzRequest], None]], None]) -> list[Outcome]:
        """Send what ``produce`` hands to its sink, ``concurrency`` at a time; returns the outcomes."""
        pending: queue.Queue[tuple[int, FuzzRequest] | None] = queue.Queue(maxsize=self.concurrency * 2)
        lock = threading.Lock()

        def worker() -> None:
            # No keep-alive: a pooled connection the server closes as idle just when it is reused would read
            # as a reset; one connection per request, so any reset is the proxy's.
            with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0),
                              limits=httpx.Limits(max_keepalive_connections=0)) as client:
                while (item := pending.get()) is not None:
                    outcome = send(client, self.base_url, self.sessions, item[0], self.tag, item[1])
                    with lock:
                        self.outcomes.append(outcome)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.concurrency)]
        for thread in threads:
            thread.start()
        counter = iter(range(len(self.outcomes), sys.maxsize))
        try:
            produce(lambda request: pending.put((next(counter), request)))
        finally:
            for _ in threads:
                pending.put(None)
            for thread in threads:
                thread.join()
        self.outcomes.sort(key=lambda o: o.index)
        return self.outcomes

    def run_list(self, requests: Iterable[FuzzRequest]) -> list[Outcome]:
        def produce(sink: Callable[[FuzzRequest], None]) -> None:
            for request in requests:
                sink(request)
        return self.run(produce)


async def read_completions(kafka: KafkaSettings, want: int, timeout_s: float = 60.0,
                           quiet_s: float = 3.0) -> tuple[list[Completion], int]:
    """Every completion event on the topic: until ``want`` are there and nothing new came for ``quiet_s``
    (or ``timeout_s`` passed); also how many records could not be decoded."""
    got: list[Completion] = []
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False,
                             service="fuzz") as consumer:
        deadline = time.monotonic() + timeout_s
        last_new = time.monotonic()
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            if batch:
                got.extend(r.event for r in batch if isinstance(r.event, Completion))
                last_new = time.monotonic()
            elif time.monotonic() - last_new > (quiet_s if len(got) >= want else max(quiet_s, 10.0)):
                break
        return got, consumer.skipped


# -- accounting ---------------------------------------------------------------------------------------

FIGURES = ("requests", "authenticated_calls", "status_5xx", "hangs", "connection_resets", "unshaped_errors",
           "bad_replies", "auth_violations", "cross_session_recordings", "duplicate_events", "sequence_gaps",
           "event_status_mismatch", "untagged_events", "undecodable_events", "calls_without_event", "faults")


@dataclass
class Report:
    """The figures of a campaign and, per kind of fault, its examples (the smallest request first)."""

    figures: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[tuple[int, str]]] = field(default_factory=lambda: defaultdict(list))

    def fault(self, figure: str, signature: str, request: FuzzRequest | None, detail: str) -> None:
        self.figures[figure] += 1
        self.figures["faults"] += 1
        size = len(request.body) if request is not None else 0
        reproducer = (request.describe() + " -> " if request is not None else "") + detail
        self.examples[f"{figure}: {signature}"].append((size, reproducer))

    def line(self) -> str:
        names = ("requests", "status_5xx", "hangs", "cross_session_recordings", "calls_without_event")
        return "fuzz " + " ".join(f"{n}={self.figures[n]}" for n in names) + \
            " " + " ".join(f"{n}={self.figures[n]}" for n in FIGURES if n not in names)

    def lines(self) -> list[str]:
        return [f"{name}={self.figures[name]}" for name in FIGURES]

    def status_line(self) -> str:
        """How the answers were spread over statuses (``exc`` for no answer), e.g. ``statuses=200:310,400:92``."""
        return "statuses=" + ",".join(f"{k}:{v}" for k, v in sorted(self.statuses.items()))

    def reproducers(self, limit: int = 40) -> list[str]:
        out = []
        for key, found in sorted(self.examples.items(), key=lambda kv: -len(kv[1]))[:limit]:
            size, reproducer = min(found)
            out.append(f"[{len(found)}x] {key}\n    {reproducer[:900]}")
        return out


_FIGURE_OF = {"status_5xx": "status_5xx", "hang": "hangs", "connection_reset": "connection_resets",
              "unshaped_error": "unshaped_errors", "bad_reply": "bad_replies", "auth": "auth_violations"}


def account(outcomes: list[Outcome], events: list[Completion], sessions: list[FuzzSession], tag: str,
            undecodable: int = 0) -> Report:
    """Judge the run as a whole: the per-request faults, then the events against the calls sent."""
    report = Report()
    report.figures["requests"] = len(outcomes)
    report.figures["undecodable_events"] = undecodable
    if undecodable:
        report.figures["faults"] += undecodable
    by_index = {o.index: o for o in outcomes}
    session_ids = [s.session_id for s in sessions]
    for outcome in outcomes:
        report.statuses[str(outcome.status) if outcome.status is not None else "exc"] += 1
        for fault in outcome.faults:
            kind, _, detail = fault.partition(":")
            signature = f"{outcome.request.api} {outcome.status or outcome.exception} " \
                        f"{_first_op(outcome.request)} {detail[:80]}"
            report.fault(_FIGURE_OF[kind], signature, outcome.request,
                         f"status={outcome.status} {outcome.exception or ''} {detail} reply={outcome.body_excerpt!r}")
        if outcome.request.auth.authenticated and outcome.request.records:
            report.figures["authenticated_calls"] += 1

    prefix = f"{_TAG}/{tag}/"
    recorded: dict[int, list[Completion]] = defaultdict(list)
    per_session: dict[str, list[Completion]] = defaultdict(list)
    for event in events:
        if event.session_id not in session_ids:
            continue
        per_session[event.session_id].append(event)
        agent = event.agent_hints.get("user-agent", "")
        if not agent.startswith(prefix) or not agent[len(prefix):].isdigit():
            report.fault("untagged_events", "event without this run's user-agent tag", None,
                         f"{event.session_id}/{event.sequence} status={event.status}")
            continue
        recorded[int(agent[len(prefix):])].append(event)

    for index, found in recorded.items():
        outcome = by_index.get(index)
        if outcome is None:
            continue
        key_session = outcome.session_of_key
        owner = session_ids[key_session] if key_session is not None else None
        if not outcome.request.auth.authenticated or any(e.session_id != owner for e in found):
            report.fault("cross_session_recordings", f"{outcome.request.auth} recorded", outcome.request,
                         f"recorded under {[e.session_id for e in found]}, key belongs to {owner}")
            continue
        if len(found) > 1:
            report.fault("duplicate_events", f"{outcome.request.api} {len(found)} events", outcome.request,
                         f"{len(found)} events: sequences {[e.sequence for e in found]}")
        event = found[0]
        if outcome.request.disconnect:
            continue  # the harness left: an ok event (it had finished) or client_disconnected, either is right
        if outcome.status is not None and (outcome.status == 200) != (event.status == "ok"):
            report.fault("event_status_mismatch", f"{outcome.request.api} http {outcome.status} event "
                         f"{event.status}", outcome.request,
                         f"http {outcome.status}, event status={event.status} error={event.error}")
        elif outcome.status is not None and outcome.status != 200 and event.error is not None \
                and event.error.http_status != outcome.status:
            report.fault("event_status_mismatch", f"{outcome.request.api} http {outcome.status} event says "
                         f"{event.error.http_status}", outcome.request,
                         f"http {outcome.status}, event error={event.error}")
    for outcome in outcomes:
        request = outcome.request
        if request.auth.authenticated and request.records and outcome.index not in recorded \
                and outcome.exception is None:
            report.fault("calls_without_event", f"{request.api} {outcome.status} {_first_op(request)}", request,
                         f"status={outcome.status} reply={outcome.body_excerpt[:200]!r}")

    for session_id in session_ids:
        sequences = sorted(e.sequence for e in per_session[session_id])
        expected = list(range(len(sequences)))
        if sequences != expected:
            missing = sorted(set(range(max(sequences, default=-1) + 1)) - set(sequences))
            duplicated = [s for s, n in Counter(sequences).items() if n > 1]
            report.fault("sequence_gaps", f"session {session_id}", None,
                         f"{len(sequences)} events, missing sequences {missing[:20]}, duplicated {duplicated[:20]}")
    return report


def _first_op(request: FuzzRequest) -> str:
    """What a fault is grouped by besides its API and status: the first real mutation, and the extra
    headers (hostile header values fail on their own, whatever the body)."""
    first = next((m for m in request.mutations if m.op not in ("utf-8-body", "stream", "noop")), None)
    where = first.value if first and first.op in ("raw-body", "content-type", "method", "signature", "deep") \
        else (first.where if first else "")
    headers = ",".join(f"{name}={value[:8]!r}" for name, value in request.headers)
    return (f"{first.op}:{where}" if first else "unmutated") + (f" +headers[{headers}]" if headers else "")


# -- the command line ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _kafka_broker() -> Iterator[str]:
    """A broker: ``ROLLWIRE_KAFKA_BOOTSTRAP`` if it answers, else one started for this run."""
    from deploy.kafka import KafkaBroker, KafkaConfig
    from schemas.transport.admin import broker_answers

    configured = os.environ.get("ROLLWIRE_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
    if broker_answers(configured):
        yield configured
        return
    import tempfile

    from tests.servers import free_port

    base = KafkaConfig.from_env()
    with tempfile.TemporaryDirectory(prefix="rollwire-fuzz-kafka-") as home:
        config = KafkaConfig(version=base.version, cache_dir=base.cache_dir, home=home, host="127.0.0.1",
                             port=free_port(), controller_port=free_port(), heap=base.heap,
                             max_message_bytes=base.max_message_bytes)
        broker = KafkaBroker(config)
        broker.start(timeout_s=240)
        try:
            yield config.bootstrap
        finally:
            broker.stop()


def main(argv: list[str] | None = None) -> int:
    from tests.support.standin_engine import StandinConfig, create_app as create_standin
    from proxy.app import create_app
    from proxy.settings import ProxySettings
    from schemas.transport.admin import delete_topics, ensure_topics
    from tests.proxy.fuzz_requests import large_body_requests
    from tests.servers import serve

    parser = argparse.ArgumentParser(description="Fuzz the gateway proxy with mutated provider requests.")
    parser.add_argument("--requests", type=int, default=2000, help="generated requests to send")
    parser.add_argument("--seed", type=int, default=1, help="Hypothesis seed (the same seed, the same requests)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--no-large", action="store_true", help="leave out the 8 and 16 MiB bodies")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    with _kafka_broker() as bootstrap:
        kafka = KafkaSettings(kafka_bootstrap=bootstrap, topic_prefix=f"fuzz{uuid.uuid4().hex[:8]}.",
                              session_partitions=4, task_partitions=2)
        asyncio.run(ensure_topics(kafka))
        try:
            standin = create_standin(StandinConfig(latency_ms=1, reply_tokens=16))
            with serve(standin) as engine_url, serve(create_app(ProxySettings(
                    engine_url=engine_url, session_wait_s=0.3, capture_timeout_s=5.0, engine_timeout_s=10.0),
                    kafka)) as proxy_url:
                sessions = campaign_sessions(proxy_url)
                campaign = Campaign(proxy_url, sessions, concurrency=args.concurrency)
                if not args.no_large:
                    campaign.run_list(large_body_requests())
                campaign.run(lambda sink: generate(args.requests, args.seed, sink))
                want = sum(1 for o in campaign.outcomes if o.request.auth.authenticated and o.request.records)
                events, undecodable = asyncio.run(read_completions(kafka, want))
        finally:
            asyncio.run(delete_topics(bootstrap, kafka.topic_prefix))
    report = account(campaign.outcomes, events, sessions, campaign.tag, undecodable)
    for reproducer in report.reproducers():
        print(reproducer)
    print(report.status_line())
    print(f"seconds={time.perf_counter() - started:.1f}")
    print(f"requests_per_second={len(campaign.outcomes) / max(1e-9, time.perf_counter() - started):.1f}")
    for line in report.lines():
        print(line)
    return 0 if report.figures["faults"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
