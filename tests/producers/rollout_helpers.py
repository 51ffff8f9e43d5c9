"""Helpers for the rollout tests: a rollout server on a real socket, reading topics, a callback receiver."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from producers.rollout.server import create_app
from producers.rollout.settings import RolloutServerSettings
from schemas.envelope import Event
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from tests.servers import serve


def task_body(task_id: str, *, samples: int = 2, **extra: Any) -> dict[str, Any]:
    # max_retries 0: these tests follow the sessions they end by hand; no gateway node runs resubmissions.
    body: dict[str, Any] = {"task_id": task_id, "instruction": "Fix the bug so the tests pass.",
                            "num_samples": samples, "agent": {"harness": "qwen-code"}, "max_retries": 0}
    body.update(extra)
    return body


@contextmanager
def rollout_server(kafka: KafkaSettings, state_dir: Path, **settings: Any) -> Iterator[str]:
    """A rollout server over ``kafka``; yields its URL once it has read the log (healthy)."""
    values: dict[str, Any] = {"state_dir": state_dir, "callback_backoff_s": 0.05, "callback_max_backoff_s": 0.2}
    values.update(settings)
    with serve(create_app(RolloutServerSettings(**values), kafka)) as url:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, timeout_s=90,
                   what="server caught up")
        yield url


def wait_until(check: Callable[[], object], *, timeout_s: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


async def publish(kafka: KafkaSettings, *events: Event) -> None:
    async with EventProducer(kafka, service="test") as producer:
        await producer.send_many(list(events))


async def read_topic(kafka: KafkaSettings, topic: Topic, want: int, timeout_s: float = 20.0) -> list[Event]:
    got: list[Event] = []
    async with EventConsumer(kafka, [topic], group_id=None, dead_letters=False) as consumer:
        async def loop() -> None:
            while len(got) < want:
                got.extend(r.event for r in await consumer.getmany(timeout_ms=300))
        await asyncio.wait_for(loop(), timeout_s)
        got.extend(r.event for r in await consumer.getmany(timeout_ms=500))
    return got


def task_status(url: str, task_id: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/tasks/{task_id}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


@dataclass
class CallbackReceiver:
    """An HTTP endpoint that refuses the first ``failures`` POSTs with 503, then accepts."""

    failures: int
    bodies: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/results")
        async def results(request: Request) -> JSONResponse:
            self.attempts += 1
            if self.attempts <= self.failures:
                return JSONResponse({"error": "busy"}, status_code=503)
            self.bodies.append(await request.json())
            return JSONResponse({"ok": True})

        return app
