"""Durable capture: turning a served call into a completion event and getting the broker's ack.

The :class:`Recorder` owns the proxy's Kafka producer. ``record`` returns only when the broker has the
event; when Kafka fails it raises :class:`~proxy.errors.CaptureFailed` (the caller withholds the reply)
and replaces its producer, so that the proxy recovers by itself once Kafka is back. An event that can
never be written as it is (over the record limit, or not encodable) is not a Kafka failure: the producer
is kept, and :meth:`Recorder.record_completion` writes a slimmed failed-call event in its place, so the
call's tokens are never lost (:func:`slimmed`). A served call's keyframe that is over the record limit is
first tried as a prompt delta against its branch's previous event (a long session with a 1M-token context
reaches the limit at its periodic keyframe, while its delta holds only the new turn), so that the call
stays a served, trainable one; its chain then runs past the usual keyframe interval.

What a refused call's event holds: ``status: error`` with ``error.kind``/``message``/``http_status``;
``request.messages`` empty when the body could not be read or parsed (too large, wrong media type, not
JSON, nested too deep, invalid for the API); ``request_digest`` the sha256 of the body as received, or
None when it was never read (over the size limit, wrong media type); no token ids.

A served call's event may be a prompt delta against its branch's previous event (``proxy/calls.py``,
:mod:`schemas.prompt_chain`); a failed call's event is always a keyframe (built here, never delta-encoded),
so a call that failed never becomes a parent.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from aiokafka.structs import RecordMetadata

from proxy.turns import EngineTurn, packed_token_ids
from proxy.errors import CaptureFailed, ProxyError, UnrecordableEvent
from proxy.settings import CaptureCompression
from proxy.stages import StageTimes
from schemas.arrays import Logprobs, TokenIds
from schemas.completions import (
    AssistantMessage,
    CallError,
    CallTimings,
    Completion,
    Continuation,
    NormalizedRequest,
    ProviderApi,
    Restore,
    Usage,
)
from schemas.envelope import Event, utcnow
from schemas.topics import Topic
from schemas.transport import EventProducer, KafkaAdmin, KafkaSettings
from schemas.transport.errors import EventTooLargeError, TransportError

logger = logging.getLogger(__name__)


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass
class CallContext:
    """Everything known about one model call before the engine answers.

    The call's number (``sequence``, and ``retry_of``) comes from its claim on the log, which is written
    while the call is parsed, placed and sent to the engine (``numbering``): :meth:`numbered` waits for it,
    and nothing the harness sees, nothing recorded, depends on the number before that wait."""

    api: ProviderApi
    session_id: str
    task_id: str | None
    policy_version: str | None
    sequence: int  # -1 until the claim is read back (see numbered)
    requested_model: str | None
    served_model: str | None
    digest: str | None
    body: str | None = None
    retry_of: int | None = None
    retry_count: int = 0
    agent_hints: dict[str, str] = field(default_factory=dict)
    received_at: datetime = field(default_factory=utcnow)
    upstream_started_at: datetime | None = None
    first_token_at: datetime | None = None
    continuation: Continuation | None = None
    weight_versions: list[dict[str, Any]] | None = None
    engine: str | None = None  # the engine that served (or last refused) the call
    engine_attempts: int = 1
    proxy: str | None = None  # the serving process's name within the tier
    restore: Restore | None = None  # the read of the session's log before the call was placed, if any
    caught_up: bool = False  # the session's branches were brought up to the log for this call
    restore_failed: str | None = None  # why they may still be behind it (the call is then rendered whole)
    stages: StageTimes = field(default_factory=StageTimes)
    # The claim on its way: (sequence, retry_of) once this process's reader has passed it; None once taken.
    numbering: asyncio.Future[tuple[int, int | None]] | None = None

    def numbered_now(self) -> bool:
        """Whether the call's number is in (taken into ``sequence``); raises the claim's CaptureFailed."""
        if self.numbering is None:
            return True
        if not self.numbering.done():
            return False
        self._take(self.numbering.result())
        return True

    async def numbered(self) -> int:
        """The call's number, once its claim is read back (CaptureFailed when it cannot be had). The claim
        itself is shielded: a caller that gives up waiting never cancels it."""
        if self.numbering is not None:
            self._take(await asyncio.shield(self.numbering))
        return self.sequence

    def _take(self, number: tuple[int, int | None]) -> None:
        self.sequence, self.retry_of = number
        self.numbering = None

    @property
    def label(self) -> str:
        """``session/sequence`` for logs (``?`` while the number is not in)."""
        return f"{self.session_id}/{self.sequence if self.numbering is None else '?'}"


EMPTY_REQUEST = NormalizedRequest(messages=[])


def slimmed(event: Completion, reason: UnrecordableEvent) -> Completion:
    """A failed-call event that fits where ``event`` did not: the request and body dropped, tokens kept.

    A call that had already failed keeps its own error (the note says what was dropped); a served call
    becomes a failed one with ``reason``. A delta stays a delta for its tokens but takes no messages or
    tools from its parent: it resolves, like a slimmed keyframe, to the full prompt and no request."""
    error = reason.call_error()
    if event.error is not None:
        error = event.error.model_copy(update={"message": f"{event.error.message} [request not recorded: "
                                                          f"{reason.message}]"})
    delta = event.prompt_delta
    if delta is not None:
        delta = delta.model_copy(update={"messages_prefix": 0, "tools_inherited": False})
    return event.model_copy(update={
        "request": EMPTY_REQUEST, "request_body": None, "status": "error", "error": error, "message": None,
        "prompt_delta": delta,
    })


def _ms(start: datetime, end: datetime | None) -> float | None:
    return None if end is None else max(0.0, (end - start).total_seconds() * 1000)


def completion_event(ctx: CallContext, request: NormalizedRequest, turn: EngineTurn | None,
                     error: ProxyError | None = None) -> Completion:
    """The completion event for a call that produced ``turn`` or failed with ``error``."""
    finished = utcnow()
    timings = CallTimings(received_at=ctx.received_at, upstream_started_at=ctx.upstream_started_at,
                          first_token_at=ctx.first_token_at, finished_at=finished,
                          ttft_ms=_ms(ctx.received_at, ctx.first_token_at), total_ms=_ms(ctx.received_at, finished))
    status: Literal["ok", "error"] = "ok"
    call_error: CallError | None = None
    tokens: EngineTurn | None = turn  # the turn whose token ids the event keeps
    logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    message: AssistantMessage | None = None
    stop_reason: int | str | None = None
    if error is not None:
        status, call_error = "error", error.call_error()
        # A failed call keeps what the engine had sampled before it failed, if anything.
        tokens = turn if turn is not None and turn.token_ids else None
        if tokens is not None and len(tokens.logprobs) == len(tokens.token_ids):
            logprobs = tokens.logprobs
    else:
        assert turn is not None
        logprobs = turn.logprobs or None
        finish_reason, stop_reason = turn.finish_reason, turn.stop_reason
        message = AssistantMessage(content=turn.content, reasoning=turn.reasoning, tool_calls=turn.tool_calls)
    if ctx.numbering is not None:
        raise RuntimeError(f"call {ctx.label}: an event is built only once the call is numbered")
    return Completion(
        session_id=ctx.session_id, task_id=ctx.task_id, sequence=ctx.sequence, agent_hints=ctx.agent_hints,
        api=ctx.api, requested_model=ctx.requested_model, served_model=ctx.served_model,
        policy_version=ctx.policy_version, request=request, request_digest=ctx.digest, request_body=ctx.body,
        retry_of=ctx.retry_of, retry_count=ctx.retry_count, timings=timings,
        continuation=_with_restore(ctx.continuation, ctx.restore), weight_versions=ctx.weight_versions,
        engine=ctx.engine, engine_attempts=ctx.engine_attempts, status=status, error=call_error,
        prompt_token_ids=_prompt_ids(tokens) if tokens is not None else None,
        token_ids=packed_token_ids(tokens.token_ids) if tokens is not None else None,
        logprobs=Logprobs(logprobs) if logprobs is not None else None,
        finish_reason=finish_reason, stop_reason=stop_reason, proxy=ctx.proxy, message=message,
        usage=tokens.usage if tokens is not None else Usage(),
    )


def _with_restore(continuation: Continuation | None, restore: Restore | None) -> Continuation | None:
    if continuation is None or restore is None:
        return continuation
    return continuation.model_copy(update={"restore": restore})


def _prompt_ids(turn: EngineTurn) -> TokenIds:
    packed = turn.packed_prompt
    if packed is not None and len(packed) == len(turn.prompt_token_ids):
        return packed
    return packed_token_ids(turn.prompt_token_ids)


async def settle_compression(settings: KafkaSettings, timeout_s: float) -> Literal["broker", "producer"]:
    """What ``capture_compression=auto`` means on this cluster: ``producer`` when the completions topic
    keeps batches as producers send them (``compression.type=producer``, a topic created before the
    registry set zstd), else ``broker`` (the topic compresses, or is meant to be uncompressed).
    TransportError when the broker does not say."""
    async with KafkaAdmin(settings.kafka_bootstrap, client_id=f"{settings.kafka_client_id}-proxy",
                          timeout_s=timeout_s) as admin:
        codec = await admin.topic_config(settings.registry().name(Topic.COMPLETIONS), "compression.type")
    return "producer" if codec in (None, "producer") else "broker"


_CLAIM_TYPE = "call.claimed"  # schemas.call_claims.CallClaim: written through a producer of its own


class Recorder:
    """Writes the proxy's events (completions, ad-hoc session specs) and waits for the broker's ack.

    ``producers`` (``ROLLWIRE_CAPTURE_PRODUCERS``): how many producers share the writes. aiokafka keeps
    one produce request in flight per broker, so under many concurrent calls their acks queue behind each
    other; with several producers several requests are in flight. Call claims go through one more producer of
    their own. An event goes to the producer its key
    picks, so a session's events (the key of completions) keep their order through one producer.
    ``compression`` (``ROLLWIRE_CAPTURE_COMPRESSION``): whether the producers compress with zstd or leave
    it to the broker (see ProxySettings.capture_compression).
    """

    def __init__(self, settings: KafkaSettings, timeout_s: float, producers: int = 1,
                 on_outage_end: Callable[[float], None] | None = None,
                 compression: CaptureCompression = "producer") -> None:
        if producers < 1:
            raise ValueError(f"a recorder needs at least one producer, got {producers}")
        self.settings = settings
        self.timeout_s = timeout_s
        self.compression: CaptureCompression = compression  # `auto` is settled by the first producer
        self._settling = asyncio.Lock()
        # One producer more than asked for, for call claims alone: a claim is a call's first write and must not
        # queue behind the completion events (large, one request in flight per producer) of other calls' ends.
        self._producers: list[EventProducer | None] = [None] * (producers + 1)
        self._locks = [asyncio.Lock() for _ in range(producers + 1)]
        self.recorded = 0
        self.failures = 0
        # An outage: from the first capture that failed to the next that succeeded (harnesses got retryable
        # errors meanwhile: Kafka down, or no leader for a partition while it moved). Its length is reported
        # to ``on_outage_end`` when it is over.
        self.failing_since: float | None = None
        self._on_outage_end = on_outage_end

    def _failed(self) -> None:
        self.failures += 1
        if self.failing_since is None:
            self.failing_since = time.monotonic()

    def _succeeded(self) -> None:
        self.recorded += 1
        if self.failing_since is not None:
            outage, self.failing_since = time.monotonic() - self.failing_since, None
            logger.warning("capture recovered after %.1f s of failures", outage)
            if self._on_outage_end is not None:
                self._on_outage_end(outage)

    def _slot(self, event: Event) -> int:
        events = len(self._producers) - 1
        if event.event_type == _CLAIM_TYPE:
            return events
        if events == 1:
            return 0
        return zlib.crc32(event.key()) % events

    async def _ready_producer(self, slot: int = 0) -> EventProducer:
        async with self._locks[slot]:
            producer = self._producers[slot]
            if producer is None:
                producer = EventProducer(self.settings, service="proxy", compress=await self._compresses())
                await asyncio.wait_for(producer.start(), self.timeout_s)
                self._producers[slot] = producer
            return producer

    async def _compresses(self) -> bool:
        """Whether the producers compress (ProxySettings.capture_compression). ``auto`` asks the broker
        how the completions topic compresses, once it answers; until then the producers compress, so a
        topic that keeps batches as the producer sends them is never filled uncompressed."""
        async with self._settling:
            if self.compression == "auto":
                try:
                    self.compression = await asyncio.wait_for(settle_compression(self.settings, self.timeout_s),
                                                              self.timeout_s)
                except (TransportError, TimeoutError, OSError) as exc:
                    logger.warning("cannot read the completions topic's compression.type (%s): this producer "
                                   "compresses", exc)
                    return True
                logger.info("captured events are compressed by the %s", self.compression)
            return self.compression == "producer"

    async def start(self) -> None:
        """Connect now if Kafka is there; if not, the first record() tries again."""
        results = await asyncio.gather(*(self._ready_producer(slot) for slot in range(len(self._producers))),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, TransportError | TimeoutError):
                raise result

    async def stop(self) -> None:
        for slot, producer in enumerate(self._producers):
            if producer is not None:
                self._producers[slot] = None
                await producer.stop()

    async def ensure_ready(self) -> None:
        """Fail fast (CaptureFailed) when no producer can be had, before any token is served."""
        if self._producers[0] is not None:
            return
        try:
            await self._ready_producer()
        except (TransportError, TimeoutError, OSError) as exc:
            self._failed()
            raise CaptureFailed(f"Kafka is unavailable, so the call cannot be recorded ({exc!r}); "
                                "retry shortly") from exc

    async def record(self, event: Event) -> RecordMetadata:
        """Return where the broker put ``event`` once it has it; raise CaptureFailed (Kafka failed,
        retryable) or UnrecordableEvent (this event can never be written as it is)."""
        slot = self._slot(event)
        try:
            producer = await self._ready_producer(slot)
            # asyncio.timeout, not wait_for: no task of its own, so one loop turn less before the ack counts.
            async with asyncio.timeout(self.timeout_s):
                written = await producer.send(event)
        except EventTooLargeError as exc:
            raise UnrecordableEvent(f"the call is too large to record: {exc}") from exc
        except (TypeError, ValueError, RecursionError) as exc:
            # orjson refuses what JSON cannot hold; the producer itself is fine.
            logger.warning("event %s not encodable: %r", event.event_id, exc)
            raise UnrecordableEvent(f"the call cannot be recorded: its event is not encodable ({exc})") from exc
        except (TransportError, TimeoutError, OSError) as exc:
            self._failed()
            await self._discard_producer(slot)
            raise CaptureFailed(f"the call could not be recorded (Kafka: {exc!r}); retry shortly") from exc
        self._succeeded()
        return written

    async def record_completion(self, event: Completion,
                                smaller: Callable[[], Completion | None] | None = None) -> Completion:
        """Record a completion and return the event written: ``event``, or, if that cannot be written as it
        is, what ``smaller`` gives (the same call as a prompt delta, when ``event`` is a keyframe that has
        a parent). If neither can, write :func:`slimmed` and raise the reason (marked recorded), so the
        caller answers with it but never records the call twice (the slimmed delta when there is one: it
        holds only the new tokens)."""
        try:
            await self.record(event)
            return event
        except UnrecordableEvent as reason:
            failure = reason
        alternative = smaller() if smaller is not None else None
        if alternative is not None:
            try:
                await self.record(alternative)
                logger.info("call %s/%d written as a delta: its keyframe would not fit (%s)", event.session_id,
                            event.sequence, failure.message)
                return alternative
            except UnrecordableEvent:
                pass
        # Slimmed, the delta keeps only the new tokens: it fits where the keyframe's whole prompt may not.
        await self.record(slimmed(alternative if alternative is not None else event, failure))
        failure.recorded = True
        raise failure

    async def _discard_producer(self, slot: int) -> None:
        async with self._locks[slot]:
            producer, self._producers[slot] = self._producers[slot], None
        if producer is not None:
            # Stopping flushes; with the broker gone that can hang, so let it finish in the background.
            asyncio.get_running_loop().create_task(producer.stop())

    @property
    def connected(self) -> bool:
        return any(producer is not None for producer in self._producers)
