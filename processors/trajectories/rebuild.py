"""``rollwire rebuild``: re-derive trajectories from the retained log, outside the worker (no Faust).

Reads ``sessions``, ``session-events`` and ``completions`` from the beginning up to their current ends
with a plain consumer (no group, nothing committed), groups the events by session, builds every selected
session that has ended with the builder asked for, and writes the Trajectory events to the target topic
with the typed producer (the topic is created like the registry's ``trajectories`` if it is missing).
Sessions without an end event are skipped (still running, or abandoned: the worker builds those as
partial). The builders are pure, so rebuilding with the same builder gives the same event ids as the
worker did.

It holds the selected sessions' events in memory while it reads: select with ``--sessions`` or
``--from`` on a large log.

Prompt deltas are resolved per session (:func:`schemas.prompt_chain.resolve_session`) before building, as
the worker does. A completion whose parent is not in the log (retention deleted it, a damaged record) is
left out of its session's build and counted (``completions_missing_parent``) with the reason logged; the
rebuild reads the log beside the worker and dead-letters nothing (the worker's group dead-letters it once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from processors.builders import SessionFacts, build_trajectory, get_builder
from schemas.completions import Completion
from schemas.prompt_chain import resolve_session
from schemas.sessions import SessionEnded, SessionSpec
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, EventProducer, ExtraTopic, ensure_topics
from schemas.transport.settings import KafkaSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebuildRequest:
    builder: str
    to_topic: str
    since: datetime | None = None  # sessions with any event at or after this time
    sessions: frozenset[str] = frozenset()  # only these (all when empty)


@dataclass
class _Session:
    completions: list[Completion] = field(default_factory=list)
    spec: SessionSpec | None = None
    end: SessionEnded | None = None
    latest: datetime | None = None


async def read_log(settings: KafkaSettings, request: RebuildRequest) -> dict[str, _Session]:
    """Every selected session's events, read from the start of the log to its current end."""
    sessions: dict[str, _Session] = {}
    topics = [Topic.SESSIONS, Topic.SESSION_EVENTS, Topic.COMPLETIONS]
    async with EventConsumer(settings, topics, group_id=None, service="rebuild", dead_letters=False) as consumer:
        idle_rounds = 0
        while True:
            received = await consumer.getmany(timeout_ms=500)
            for r in received:
                session_id = getattr(r.event, "session_id", None)
                if not session_id or (request.sessions and session_id not in request.sessions):
                    continue
                session = sessions.setdefault(session_id, _Session())
                if isinstance(r.event, Completion):
                    session.completions.append(r.event)
                elif isinstance(r.event, SessionSpec):
                    session.spec = r.event
                elif isinstance(r.event, SessionEnded):
                    session.end = r.event
                if session.latest is None or r.event.occurred_at > session.latest:
                    session.latest = r.event.occurred_at
            if received:
                idle_rounds = 0
            elif await consumer.lag() == 0 and consumer.assignment():
                break
            else:
                idle_rounds += 1
                if idle_rounds > 20 and not consumer.assignment():
                    break  # nothing to read at all
    return sessions


async def _ensure_topic(settings: KafkaSettings, name: str) -> None:
    """The target topic, created like the registry's trajectories topic if it is missing."""
    await ensure_topics(settings, [ExtraTopic.like(settings.registry().spec(Topic.TRAJECTORIES), name)])


def _trajectories(sessions: dict[str, _Session], request: RebuildRequest, since: datetime | None,
                  counts: dict[str, int]) -> list[Trajectory]:
    """The trajectory of every selected session that has ended, in session id order; counts what it skips."""
    out = []
    for session_id in sorted(sessions):
        session = sessions[session_id]
        if since is not None and (session.latest is None or session.latest < since):
            continue
        if session.end is None:
            counts["open_skipped"] += 1
            continue
        spec, end = session.spec, session.end
        facts = SessionFacts(session_id=session_id, task_id=(spec.task_id if spec else None) or end.task_id,
                             policy_version=spec.policy_version if spec else None, status=end.status,
                             failure=end.failure, partial=False, ended_at=end.occurred_at)
        chain = resolve_session(session.completions)
        for missing in chain.missing:
            counts["completions_missing_parent"] += 1
            logger.warning("session %s: completion %s (sequence %d) left out: %s", session_id,
                           missing.completion.event_id, missing.completion.sequence, missing.reason)
        out.append(build_trajectory(request.builder, chain.resolved, facts))
    return out


async def rebuild(settings: KafkaSettings, request: RebuildRequest) -> dict[str, Any]:
    """Rebuild and write; returns counts (sessions, trajectories, open_skipped, traces,
    completions_missing_parent)."""
    get_builder(request.builder)  # unknown builder: fail before reading anything
    since = request.since
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=timezone.utc)
    sessions = await read_log(settings, request)
    await _ensure_topic(settings, request.to_topic)
    counts = {"sessions_read": len(sessions), "trajectories": 0, "open_skipped": 0, "traces": 0,
              "completions_missing_parent": 0}
    trajectories = _trajectories(sessions, request, since, counts)
    async with EventProducer(settings, service="rebuild") as producer:
        await producer.send_many(trajectories, to=request.to_topic)
    counts["trajectories"] = len(trajectories)
    counts["traces"] = sum(len(t.traces) for t in trajectories)
    return counts
