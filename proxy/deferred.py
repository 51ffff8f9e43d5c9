"""Work a call needs before it ends but not before its next byte, run one job per turn of the event loop.

When many streams start at once, their first chunks arrive together; the part of each that the harness
does not wait for (reading a long prompt's ids into an array) would otherwise run back to back and hold
every other stream's first bytes behind it. Jobs queued here run in the order queued, one each time the
loop comes round, with the loop's socket reads and writes between them. A job must be safe to run after
its call has already done the same work itself (the call does it at once when it needs the result first).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class DeferredWork:
    """A queue of small CPU jobs for the running loop, one run per turn of it."""

    def __init__(self) -> None:
        self._jobs: deque[Callable[[], None]] = deque()
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: Callable[[], None]) -> None:
        """Run ``job`` on a later turn of the running loop, after the jobs queued before it."""
        self._jobs.append(job)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run_one)

    def _run_one(self) -> None:
        job = self._jobs.popleft()
        try:
            job()
        except Exception:  # a job's own failure is its call's to report when it needs the result
            log.exception("a deferred job failed")
        if self._jobs:
            asyncio.get_running_loop().call_soon(self._run_one)
        else:
            self._scheduled = False
