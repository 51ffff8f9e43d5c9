"""The proxy's session registry: which sessions are live, found by id or by the key a harness sends.

The registry is a view of two topics: ``sessions`` (compacted specs) and ``session-events`` (their
ends), read from the beginning by every proxy process. The proxy never invents a session: an id or key
the registry does not know, after a short wait for it to catch up, is refused, and a call addressed by
path must still carry that session's own key (:meth:`SessionRegistry.authenticate`). Each live session also
holds this process's view of its branches (:class:`~proxy.continuation.branches.BranchStore`) and how far
that view has read the session's log; call numbers come from the claims log (:mod:`proxy.tier.claims`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass, field

from aiokafka.partitioner import DefaultPartitioner

from proxy.continuation.branches import BranchStore
from proxy.errors import UnknownSession
from proxy.follow import follow_forever
from schemas.envelope import Event
from schemas.sessions import SessionEnded, SessionSpec
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings

logger = logging.getLogger(__name__)

_PARTITIONER = DefaultPartitioner()  # the producers' own: a session's records land where it says


@dataclass
class LiveSession:
    """A registered session as this proxy process tracks it."""

    spec: SessionSpec
    ended: bool = False
    first_seen_ms: int | None = None  # when its spec was first written, as the log says
    branches: BranchStore = field(default_factory=BranchStore)
    # Calls other processes served that are now in ``branches`` (or given up on), and where this process's
    # last read of the session's completions ended; reads of the log are one at a time per session.
    replayed: set[int] = field(default_factory=set)
    log_read_to: int | None = None
    restore_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    def partition(self, partitions: int) -> int:
        """The session's partition of its topics (they are keyed by session, with one partition count)."""
        key = self.session_id.encode("utf-8")
        return int(_PARTITIONER(key, list(range(partitions)), list(range(partitions))))


class SessionRegistry:
    """Live sessions by id and by API key."""

    def __init__(self) -> None:
        self._by_id: dict[str, LiveSession] = {}
        self._by_key: dict[str, str] = {}
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._by_id)

    def counts(self) -> dict[str, int]:
        ended = sum(1 for s in self._by_id.values() if s.ended)
        return {"live": len(self._by_id) - ended, "ended": ended}

    def live_since_ms(self) -> int | None:
        """When the earliest session still live was first seen on the log (None: none live, or unknown)."""
        seen = [s.first_seen_ms for s in self._by_id.values() if not s.ended and s.first_seen_ms is not None]
        return min(seen) if seen else None

    async def apply(self, event: Event, timestamp_ms: int | None = None) -> None:
        """Take a spec or an end event into the registry (``timestamp_ms``: its record's time)."""
        if isinstance(event, SessionSpec):
            current = self._by_id.get(event.session_id)
            if current is None:
                self._by_id[event.session_id] = LiveSession(event, first_seen_ms=timestamp_ms)
            elif current.spec.api_key != event.api_key:
                # Another writer's spec for a session id in use: the session stays whose it was (its key
                # keeps working, the newcomer's is never taken), so neither writes into the other's calls.
                logger.warning("ignoring a second spec for session %r with another key", event.session_id)
                return
            else:
                current.spec = event
            if event.api_key:
                self._by_key[event.api_key] = event.session_id
        elif isinstance(event, SessionEnded):
            session = self._by_id.get(event.session_id)
            if session is not None:
                session.ended = True
        else:
            return
        async with self._changed:
            self._changed.notify_all()

    def get(self, session_id: str) -> LiveSession | None:
        return self._by_id.get(session_id)

    def _lookup(self, session_id: str | None, api_key: str | None) -> LiveSession | None:
        if session_id is not None:
            return self._by_id.get(session_id)
        if api_key is not None and api_key in self._by_key:
            return self._by_id.get(self._by_key[api_key])
        return None

    async def authenticate(self, session_id: str | None, api_key: str | None, wait_s: float = 0.0) -> LiveSession:
        """The live session a call may act for; the one place that decides it.

        A call names its session by path (``session_id``) or by key alone; either way it must carry that
        session's own API key, so knowing (or guessing) a sibling's id is not enough to write into its
        trajectory. Anything else raises UnknownSession (401), before the body is read.
        """
        if not api_key:
            raise UnknownSession("no API key: send the session's key (Authorization: Bearer, x-api-key, "
                                 "x-goog-api-key or ?key=)")
        session = await self._wait_for(session_id, api_key, wait_s)
        if session is None:
            named = f"session {session_id!r}" if session_id is not None else "this API key"
            raise UnknownSession(f"{named} is not a registered rollwire session; register it first "
                                 "(POST /v1/sessions or a rollout task)")
        expected = session.spec.api_key
        if expected is None or not hmac.compare_digest(expected.encode(), api_key.encode()):
            # Same answer whether the session exists or not: an id is not a credential.
            raise UnknownSession(f"this API key is not the key of session {session_id!r}")
        if session.ended:
            raise UnknownSession(f"session {session.session_id!r} has ended")
        return session

    async def _wait_for(self, session_id: str | None, api_key: str | None, wait_s: float) -> LiveSession | None:
        """The session by id or key, waiting up to ``wait_s`` for the registry to catch up."""
        session = self._lookup(session_id, api_key)
        if session is None and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with self._changed:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._lookup(session_id, api_key) is not None), wait_s)
            session = self._lookup(session_id, api_key)
        return session


class RegistryFeed:
    """Keeps a :class:`SessionRegistry` up to date from Kafka in a background task."""

    def __init__(self, settings: KafkaSettings, registry: SessionRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.caught_up = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(follow_forever(self._follow, "the session registry"),
                                         name="rollwire-session-registry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        async with EventConsumer(self.settings, [Topic.SESSIONS, Topic.SESSION_EVENTS], group_id=None,
                                 service="proxy-registry", dead_letters=False) as consumer:
            while True:
                for received in await consumer.getmany(timeout_ms=200):
                    await self.registry.apply(received.event, received.timestamp_ms)
                if not self.caught_up.is_set() and await consumer.lag() == 0:
                    self.caught_up.set()
