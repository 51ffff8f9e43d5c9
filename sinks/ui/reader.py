"""The UI's reader: every topic the pages show, from the beginning of the log, into a :class:`RunView`.

No consumer group: the view lives in memory, so a restarted UI reads the log again (its position is
nowhere but in the view). It never dead-letters (it is not the records' processor) and commits nothing.
"""

from __future__ import annotations

import asyncio
import logging

from schemas.topics import Topic
from schemas.transport.consumer import EventConsumer
from schemas.transport.settings import KafkaSettings
from sinks.ui.view import RunView

logger = logging.getLogger(__name__)

TOPICS = (Topic.TASKS, Topic.SESSIONS, Topic.SESSION_EVENTS, Topic.COMPLETIONS, Topic.EVALUATIONS,
          Topic.TRAJECTORIES, Topic.GROUPS)


async def follow(view: RunView, settings: KafkaSettings, *, from_beginning: bool = True,
                 stop: asyncio.Event | None = None) -> None:
    """Read the topics into ``view`` until ``stop`` is set (or the task is cancelled); sets
    ``view.caught_up`` once it has read what was on the log when it started."""
    stop = stop or asyncio.Event()
    async with EventConsumer(settings, list(TOPICS), group_id=None, service="ui", from_beginning=from_beginning,
                             dead_letters=False) as consumer:
        await consumer.wait_for_assignment()
        ends = await consumer.end_offsets()
        while not stop.is_set():
            for record in await consumer.getmany_raw(timeout_ms=300, max_records=500):
                received = await consumer.take(record)
                if received is not None:
                    view.apply(received.event, len(record.value or b""))
            if not view.caught_up and await consumer.caught_up(ends):
                view.caught_up = True
                logger.info("ui view caught up: %d events, %d sessions, %d bytes", view.events,
                            len(view.sessions), view.bytes)
