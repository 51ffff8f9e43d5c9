"""The proxy's background readers of the log (the session registry, the call claims): each follows its topics
for as long as the proxy runs, and reads again after Kafka is lost rather than ending."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from schemas.transport.errors import TransportError

logger = logging.getLogger(__name__)

RETRY_S = 2.0


async def follow_forever(follow: Callable[[], Awaitable[None]], what: str) -> None:
    """Run ``follow`` (a reader that returns only when Kafka fails it) again after each TransportError."""
    while True:
        try:
            await follow()
        except asyncio.CancelledError:
            raise
        except TransportError as exc:
            logger.warning("%s lost Kafka (%s); reading again in %g s", what, exc, RETRY_S)
            await asyncio.sleep(RETRY_S)
