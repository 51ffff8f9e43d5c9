"""The rollout server (FastAPI): accepts TaskRequests, writes them to Kafka, serves their status.

``POST /v1/tasks``: validate (422 naming the field; 409 for a task id already accepted), write the
SessionSpecs (one per sample), then the `task.accepted` event, answer 202 with the session ids once the
broker has acknowledged them all. ``GET /v1/tasks/{task_id}``: every session's status,
derived from the events (producers.rollout.status). ``GET /v1/tasks/{task_id}/result``: the result once
the task is done (202 with the status before). ``GET /v1/tasks``: one line per task. ``GET /health``:
200 once the server has read the log up to its end (503 before: until then it cannot tell a new task id
from an old one, so POSTs are refused with 503 too).

A session that failed for the infrastructure is resubmitted by this server (a new session of the same
sample, linked to the one it replaces; producers.rollout.status says when), up to the task's
``max_retries`` (``ROLLWIRE_ROLLOUT_MAX_RETRIES`` when the task names none).

The server keeps no state of its own besides the record of delivered callbacks: a restarted server reads
the topics from the beginning and rebuilds the same view. One server per deployment (two servers could
both accept the same new task id in the instant before each reads the other's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from producers.rollout.callback import CallbackSender
from producers.rollout.errors import (
    InvalidTask,
    KafkaUnavailable,
    NotReady,
    RolloutError,
    TaskConflict,
    TaskNotFound,
)
from producers.rollout.expand import check_request, expand
from producers.rollout.settings import RolloutServerSettings
from producers.rollout.status import RolloutView, StatusFeed
from producers.validation_errors import install_validation_handler
from schemas.codec import unreadable_reason
from schemas.sessions import SessionSpec
from schemas.rollouts import CallbackState, TaskResult, TaskState, TaskStatus, TaskSubmitted, TaskSummary
from schemas.tasks import TaskRequest
from schemas.transport import EventProducer, KafkaSettings, TransportError
from schemas.transport.producer import default_source

logger = logging.getLogger(__name__)


@dataclass
class RolloutService:
    """The server's moving parts: the Kafka producer, the derived view and its feed, the callbacks."""

    kafka: KafkaSettings
    settings: RolloutServerSettings
    view: RolloutView
    callbacks: CallbackSender
    producer: EventProducer | None = None
    feed: StatusFeed | None = None
    source: str = field(default_factory=lambda: default_source("rollout-server"))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _reserved: set[str] = field(default_factory=set)

    async def start(self) -> None:
        # Not transactional: a transaction's commit marker takes an offset of its own on each partition, and
        # the trajectory worker tells that it has read a `sessions` partition to its end by comparing its
        # last record's offset with the high watermark, which a trailing marker keeps one ahead (sessions
        # were then never built). Specs go first and task.accepted last, so a task the log shows as
        # accepted has all its specs; a crash in between leaves specs whose task a retry accepts again
        # (same session ids, same keys on the compacted topic).
        self.producer = EventProducer(self.kafka, service="rollout-server")
        await self.producer.start()
        self.feed = StatusFeed(self.kafka, self.view, self._finished,
                               count_completions=self.settings.count_completions, on_retries=self._resubmit)
        self.feed.start()

    async def stop(self) -> None:
        if self.feed is not None:
            await self.feed.stop()
        await self.callbacks.stop()
        if self.producer is not None:
            await self.producer.stop()

    @property
    def ready(self) -> bool:
        return self.feed is not None and self.feed.caught_up.is_set()

    async def _resubmit(self, specs: list[SessionSpec]) -> None:
        """Write the resubmissions the view asks for (producers.rollout.status); a refusal is tried again on
        the feed's next turn (the view offers them until their specs are applied)."""
        assert self.producer is not None
        try:
            async with self._lock:
                await self.producer.send_many(list(specs))
        except TransportError as exc:
            logger.warning("resubmissions not written yet (%s); retrying", exc)
            return
        for spec in specs:
            self.view.apply(spec)
            logger.info("session %s resubmitted as %s (attempt %d)", spec.retry_of, spec.session_id, spec.attempt)

    def _finished(self, result: TaskResult) -> None:
        accepted = self.view.task(result.task_id)
        if accepted is not None and accepted.request.callback_url:
            self.callbacks.submit(result, accepted.request.callback_url)

    async def submit(self, request: TaskRequest) -> TaskSubmitted:
        """Accept a task: check it, write its events, fold them into the view."""
        check_request(request)
        if not self.ready:
            raise NotReady("the rollout server is still reading the log; retry in a few seconds")
        if self.view.has_task(request.task_id) or request.task_id in self._reserved:
            raise TaskConflict(f"task {request.task_id!r} was already accepted; submit it under a new "
                               "task_id (its sessions' ids derive from it)")
        self._reserved.add(request.task_id)
        try:
            accepted, specs = expand(request, source=self.source, max_retries=self.settings.max_retries)
            taken = [spec.session_id for spec in specs if self.view.session_in_use(spec.session_id)]
            if taken:
                raise TaskConflict(f"session id {taken[0]!r} of task {request.task_id!r} is already in use (an "
                                   "ad-hoc session took it?); submit the task under a new task_id")
            # What the log could not give back (a value no consumer's JSON decoder takes) is refused here:
            # accepted, it would be lost to every gateway node and to this server after a restart.
            for event in (accepted, *specs[:1]):
                if (reason := unreadable_reason(event)) is not None:
                    raise InvalidTask(("body",), f"the task's events could not be read back from the log: {reason}")
            assert self.producer is not None
            async with self._lock:
                try:
                    await self.producer.send_many(list(specs))
                    await self.producer.send_many([accepted])
                except TransportError as exc:
                    raise KafkaUnavailable(f"task {request.task_id!r} not recorded: {exc}") from exc
            # Seen at once by status queries; the feed's later copy of the same event changes nothing.
            self.view.apply(accepted)
        finally:
            self._reserved.discard(request.task_id)
        return TaskSubmitted(task_id=request.task_id, session_ids=accepted.session_ids,
                             status_url=f"/v1/tasks/{request.task_id}")

    def status(self, task_id: str) -> TaskStatus:
        status = self.view.status(task_id)
        if status is None:
            raise TaskNotFound(f"no task {task_id!r} was accepted")
        status.callback = self.callbacks.state(task_id)
        if status.callback is None and (accepted := self.view.task(task_id)) and accepted.request.callback_url:
            # Not handed to the sender yet (a restarted server folds the log first): the record of
            # deliveries still says whether an earlier run delivered it.
            delivered = task_id in self.callbacks.log
            status.callback = CallbackState(url=accepted.request.callback_url,
                                            state="delivered" if delivered else "waiting")
        return status


def _error_response(exc: RolloutError) -> JSONResponse:
    if isinstance(exc, InvalidTask):
        # The same shape as FastAPI's own validation errors, so clients read one format.
        detail: object = [{"loc": list(exc.field), "msg": exc.message, "type": "value_error"}]
    else:
        detail = str(exc)
    headers = {"retry-after": "2"} if exc.status_code == 503 else None
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)


def create_app(settings: RolloutServerSettings | None = None, kafka: KafkaSettings | None = None) -> FastAPI:
    """The rollout server app; Kafka clients start and stop with the app's lifespan."""
    settings = settings or RolloutServerSettings()
    kafka = kafka or KafkaSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = RolloutService(
            kafka=kafka, settings=settings, view=RolloutView(settings.evaluation_wait_s),
            callbacks=CallbackSender(settings.state_dir, attempts=settings.callback_attempts,
                                     backoff_s=settings.callback_backoff_s,
                                     max_backoff_s=settings.callback_max_backoff_s,
                                     timeout_s=settings.callback_timeout_s))
        await service.start()
        app.state.service = service
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="rollwire rollout server", lifespan=lifespan)
    install_validation_handler(app)

    @app.exception_handler(RolloutError)
    async def _rollout_error(request: Request, exc: RolloutError) -> JSONResponse:
        return _error_response(exc)

    def service_of(request: Request) -> RolloutService:
        return request.app.state.service

    @app.post("/v1/tasks", status_code=202, response_model=TaskSubmitted)
    async def submit_task(task: TaskRequest, request: Request) -> TaskSubmitted:
        return await service_of(request).submit(task)

    @app.get("/v1/tasks", response_model=list[TaskSummary])
    async def list_tasks(request: Request) -> list[TaskSummary]:
        return service_of(request).view.summaries()

    @app.get("/v1/tasks/{task_id}", response_model=TaskStatus, response_model_exclude_none=True)
    async def task_status(task_id: str, request: Request) -> TaskStatus:
        return service_of(request).status(task_id)

    @app.get("/v1/tasks/{task_id}/result", responses={202: {"model": TaskStatus}})
    async def task_result(task_id: str, request: Request) -> JSONResponse:
        status = service_of(request).status(task_id)
        if status.state == TaskState.DONE and status.result is not None:
            return JSONResponse(status.result.model_dump(mode="json"))
        return JSONResponse(status.model_dump(mode="json", exclude_none=True), status_code=202)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        service = service_of(request)
        body = {"status": "ok" if service.ready else "catching_up", "tasks": len(service.view.task_ids())}
        return JSONResponse(body, status_code=200 if service.ready else 503)

    return app
