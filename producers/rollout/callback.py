"""Delivering a finished task's result to its callback URL: retries with exponential backoff, one
background delivery per task so that a failing receiver never holds up another task's callback.

A delivery succeeds on any 2xx answer. Connection errors, timeouts, 5xx, 408, 425 and 429 are retried
(``attempts`` in all, waits of ``backoff_s * 2**n`` up to ``max_backoff_s``, with jitter); any other 4xx
is the receiver refusing the result and is not retried. Each POST carries ``Idempotency-Key: <task_id>``:
delivery is at least once (a restarted server re-sends a result it has no delivery record of), so a
receiver should accept the same task twice. Delivered task ids are recorded, one a line, in
``<state_dir>/callbacks-delivered.txt`` — the server's only state outside Kafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from pathlib import Path

import httpx

from schemas.envelope import utcnow
from schemas.rollouts import CallbackState, TaskResult

logger = logging.getLogger(__name__)

RETRYABLE_4XX = frozenset({408, 425, 429})


class DeliveryLog:
    """The task ids whose results were delivered, kept in a text file (appended, one id a line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ids: set[str] = set()
        if path.exists():
            self._ids = {line.strip() for line in path.read_text().splitlines() if line.strip()}

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._ids

    def record(self, task_id: str) -> None:
        if task_id in self._ids:
            return
        self._ids.add(task_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write(task_id + "\n")


class CallbackSender:
    """Sends each finished task's result to its callback URL in the background."""

    def __init__(self, state_dir: Path, *, attempts: int = 8, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, timeout_s: float = 10.0,
                 client: httpx.AsyncClient | None = None) -> None:
        if attempts < 1:
            raise ValueError("callback attempts must be at least 1 (ROLLWIRE_ROLLOUT_CALLBACK_ATTEMPTS)")
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.log = DeliveryLog(state_dir / "callbacks-delivered.txt")
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self._states: dict[str, CallbackState] = {}
        self._deliveries: dict[str, asyncio.Task[None]] = {}

    def state(self, task_id: str) -> CallbackState | None:
        return self._states.get(task_id)

    def submit(self, result: TaskResult, url: str) -> None:
        """Start delivering ``result`` to ``url`` unless it was delivered before (returns at once)."""
        if result.task_id in self._deliveries:
            return
        if result.task_id in self.log:
            self._states[result.task_id] = CallbackState(url=url, state="delivered")
            return
        self._states[result.task_id] = CallbackState(url=url)
        self._deliveries[result.task_id] = asyncio.create_task(self._deliver(result, url),
                                                               name=f"callback-{result.task_id}")

    async def wait(self, task_id: str) -> CallbackState | None:
        """Wait for a task's delivery to end (delivered or failed); for tests and drains."""
        task = self._deliveries.get(task_id)
        if task is not None:
            await asyncio.shield(task)
        return self._states.get(task_id)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Let posts already on the wire finish (up to ``grace_s``), abandon the rest (a restart re-sends
        them: the receiver sees the same idempotency key), and close the client."""
        sending = [task for task_id, task in self._deliveries.items()
                   if not task.done() and self._states[task_id].state == "sending"]
        if sending:
            await asyncio.wait(sending, timeout=grace_s)
        for task in self._deliveries.values():
            task.cancel()
        for task in self._deliveries.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._owns_client:
            await self._client.aclose()

    def _wait_s(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)

    async def _deliver(self, result: TaskResult, url: str) -> None:
        state = self._states[result.task_id]
        body = result.model_dump_json().encode("utf-8")
        headers = {"content-type": "application/json", "idempotency-key": result.task_id,
                   "user-agent": "rollwire-rollout-server"}
        for attempt in range(1, self.attempts + 1):
            state.state = "sending"
            state.attempts = attempt
            try:
                response = await self._client.post(url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                state.last_error = f"{type(exc).__name__}: {exc}"
            else:
                if response.is_success:
                    state.state = "delivered"
                    state.delivered_at = utcnow()
                    state.last_error = None
                    self.log.record(result.task_id)
                    return
                state.last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                if 400 <= response.status_code < 500 and response.status_code not in RETRYABLE_4XX:
                    break
            if attempt < self.attempts:
                state.state = "waiting"
                await asyncio.sleep(self._wait_s(attempt))
        state.state = "failed"
        logger.warning("callback for task %s to %s failed after %d attempts: %s", result.task_id, url,
                       state.attempts, state.last_error)
