"""Task and session status derived from the log: a consumer of `tasks`, `session-events`, `evaluations`
and `trajectories` (and, keys only, `completions`).

:class:`RolloutView` is the derived state (plain code, tested without Kafka); :class:`StatusFeed` keeps it
up to date from Kafka in the background, reading every topic from the beginning, so that a restarted
server rebuilds the same view. Nothing here writes to Kafka.

When a task is done (see :meth:`RolloutView.task_state`): every session has ended, and every session
that an evaluator is expected to score has an evaluation from the task's evaluator. An evaluator is not
expected to score a cancelled session or one that failed for infrastructure reasons (there is nothing
of the policy's to score). If evaluations are still missing ``evaluation_wait_s`` after the last
session ended, the task is done anyway and its result says ``complete=False``.

Resubmissions: a session that failed for the infrastructure (``schemas.attribution``: the rule of its
cause says resubmit) while its task's ``max_retries`` allows another session is *pending*: the view
offers a new spec for its sample (:meth:`RolloutView.take_retries`: same task, same sample index, a fresh
API key, ``attempt`` + 1, ``retry_of`` the session it replaces, its id from
``schemas.sessions.retry_session_id``), which the server writes; its task is not done before that session
ends. In a task's status each sample shows its latest session, with the ones it replaced under
``retries``. The new id is derived, so a restarted server that replays the log finds the spec written
and writes nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone

from producers.rollout.expand import new_api_key
from schemas.attribution import resubmitted
from schemas.codec import HEADER_EVENT_TYPE
from schemas.envelope import Event
from schemas.evaluations import Evaluation
from schemas.rollouts import (
    EvaluationView,
    RetryView,
    SessionStatusView,
    TaskResult,
    TaskState,
    TaskStatus,
    TaskSummary,
)
from schemas.sessions import (
    FailureKind,
    SessionEnded,
    SessionSpec,
    SessionStage,
    SessionStageChanged,
    SessionStatus,
    retry_session_id,
)
from schemas.tasks import TaskAccepted
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventConsumer, KafkaSettings, TransportError

logger = logging.getLogger(__name__)

STATUS_TOPICS = (Topic.TASKS, Topic.SESSIONS, Topic.SESSION_EVENTS, Topic.EVALUATIONS, Topic.TRAJECTORIES)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class RolloutView:
    """Tasks and their sessions as the events describe them. Idempotent per event id."""

    def __init__(self, evaluation_wait_s: float = 600.0) -> None:
        self.evaluation_wait_s = evaluation_wait_s
        self._tasks: dict[str, TaskAccepted] = {}
        # Sessions are kept by id, whether or not their task was read yet: the topics are read
        # independently, so a session's events can arrive before its task.
        self._sessions: dict[str, SessionStatusView] = {}
        self._completions: dict[str, int] = {}  # records counted on `completions`
        self._built_completions: dict[str, int] = {}  # as the session's trajectory counted them
        self._reported: set[str] = set()
        # Every session id a spec was written for (any origin: ad-hoc sessions too), so that a new task
        # never takes an id already in use (its calls would be counted as the task's).
        self._registered: set[str] = set()
        # Every event id folded in: a reader that restarts from the beginning changes nothing twice.
        self._applied: set[str] = set()
        # The rollout specs (what a resubmission copies), by session id.
        self._specs: dict[str, SessionSpec] = {}

    # ---- applying events ----

    def apply(self, event: Event) -> None:
        """Fold one event into the view (once per event id)."""
        if event.event_id in self._applied:
            return
        self._applied.add(event.event_id)
        match event:
            case TaskAccepted():
                self._apply_task(event)
            case SessionSpec():
                self._registered.add(event.session_id)
                if event.origin == "rollout" and event.task_id is not None:
                    self._specs.setdefault(event.session_id, event)
            case SessionStageChanged():
                self._apply_stage(event)
            case SessionEnded():
                self._apply_end(event)
            case Evaluation():
                self._apply_evaluation(event)
            case Trajectory():
                self._apply_trajectory(event)

    def session_in_use(self, session_id: str) -> bool:
        """A spec, a stage, an end or a call of ``session_id`` is on the log already."""
        return session_id in self._registered or session_id in self._sessions or session_id in self._completions

    def count_completions(self, session_id: str, n: int = 1) -> None:
        self._completions[session_id] = self._completions.get(session_id, 0) + n

    def reset_completion_counts(self) -> None:
        """Forget the counts (their reader starts over from the beginning of `completions`)."""
        self._completions.clear()

    def _session(self, session_id: str) -> SessionStatusView:
        view = self._sessions.get(session_id)
        if view is None:
            view = self._sessions[session_id] = SessionStatusView(session_id=session_id, sample_index=0)
        return view

    def _apply_task(self, event: TaskAccepted) -> None:
        if event.task_id in self._tasks:
            return  # the first acceptance wins; a repeat (redelivery, a second server) changes nothing
        self._tasks[event.task_id] = event
        for index, sid in enumerate(event.session_ids):
            self._session(sid).sample_index = index

    def _apply_stage(self, event: SessionStageChanged) -> None:
        view = self._session(event.session_id)
        if view.started_at is None and event.stage != SessionStage.QUEUED:
            view.started_at = event.occurred_at
        if event.elapsed_s is not None and view.status is None:
            previous = view.stage.value
            view.timings[previous] = view.timings.get(previous, 0.0) + event.elapsed_s
        if view.status is None:
            view.stage = event.stage
        view.node = event.node or view.node

    def _apply_end(self, event: SessionEnded) -> None:
        view = self._session(event.session_id)
        view.status = event.status
        view.failure = event.failure
        view.cause = event.cause
        view.reason = event.reason
        view.exit_code = event.exit_code
        view.ended_at = event.occurred_at
        view.patch_bytes = len(event.patch.encode("utf-8")) if event.patch is not None else None
        if event.timings:
            view.timings = dict(event.timings)

    def _apply_evaluation(self, event: Evaluation) -> None:
        view = self._session(event.session_id)
        verdict = EvaluationView(evaluator=event.evaluator, status=event.status, reward=event.reward,
                                 passed=event.passed, error=event.error)
        # The latest verdict of each evaluator counts (an evaluator may re-score a session).
        view.evaluations = [e for e in view.evaluations if e.evaluator != event.evaluator] + [verdict]

    def _apply_trajectory(self, event: Trajectory) -> None:
        view = self._session(event.session_id)
        view.trajectory_id = event.event_id
        view.traces = len(event.traces)
        view.traces_by_role = dict(getattr(event.stats, "roles", None) or {})
        view.partial = event.partial
        self._built_completions[event.session_id] = event.stats.completions

    # ---- reading the view ----

    def has_task(self, task_id: str) -> bool:
        return task_id in self._tasks

    def task_ids(self) -> list[str]:
        return list(self._tasks)

    def task(self, task_id: str) -> TaskAccepted | None:
        return self._tasks.get(task_id)

    def _latest(self, first: str, retries: int) -> tuple[str, int]:
        """The sample's latest session whose spec (or any event) is on the log: (id, attempt)."""
        for attempt in range(retries, 0, -1):
            sid = retry_session_id(first, attempt)
            if sid in self._registered or sid in self._sessions:
                return sid, attempt
        return first, 0

    def sessions(self, task_id: str) -> list[SessionStatusView]:
        """The task's samples in order, each as its latest session (the ones it replaced under
        ``retries``), with their evaluator's reward filled in."""
        accepted = self._tasks[task_id]
        evaluator = accepted.request.evaluator.name if accepted.request.evaluator else None
        retries = accepted.request.max_retries or 0
        out = []
        for index, first in enumerate(accepted.session_ids):
            sid, attempt = self._latest(first, retries)
            view = self._session(sid).model_copy(deep=True)
            view.sample_index = index
            view.attempt = attempt
            earlier = [first, *(retry_session_id(first, n) for n in range(1, attempt))]
            view.retries = [RetryView(session_id=e, cause=self._session(e).cause, reason=self._session(e).reason)
                            for e in earlier[:attempt]]
            view.retry_pending = (view.status is not None and attempt < retries
                                  and resubmitted(view.cause, view.failure))
            view.completions = max(self._completions.get(sid, 0), self._built_completions.get(sid, 0))
            verdict = next((e for e in view.evaluations if e.evaluator == evaluator), None)
            view.reward = verdict.reward if verdict is not None else None
            out.append(view)
        return out

    @staticmethod
    def _expects_evaluation(view: SessionStatusView) -> bool:
        return view.status != SessionStatus.CANCELLED and view.failure != FailureKind.INFRASTRUCTURE

    def _missing_evaluations(self, accepted: TaskAccepted, sessions: list[SessionStatusView]) -> int:
        if accepted.request.evaluator is None:
            return 0
        name = accepted.request.evaluator.name
        return sum(1 for s in sessions if self._expects_evaluation(s)
                   and not any(e.evaluator == name for e in s.evaluations))

    def task_state(self, task_id: str, now: datetime | None = None) -> TaskState:
        accepted = self._tasks[task_id]
        return self._state(accepted, self.sessions(task_id), now or _utcnow())

    def take_retries(self) -> list[SessionSpec]:
        """New specs for the samples whose latest session is pending resubmission and whose next session
        is not on the log yet (each offered until its spec is applied to the view)."""
        out = []
        for task_id, accepted in self._tasks.items():
            for index, view in enumerate(self.sessions(task_id)):
                if not view.retry_pending:
                    continue
                attempt = view.attempt + 1
                new_id = retry_session_id(accepted.session_ids[index], attempt)
                spec = self._specs.get(view.session_id) or self._specs.get(accepted.session_ids[index])
                if new_id in self._registered or spec is None:
                    continue
                fields = spec.model_dump(exclude={"event_id", "occurred_at", "emitted_at", "source"})
                fields.update(session_id=new_id, attempt=attempt, retry_of=view.session_id, api_key=new_api_key(),
                              sample_index=index)
                out.append(SessionSpec.model_validate(fields))
        return out

    def _state(self, accepted: TaskAccepted, sessions: list[SessionStatusView], now: datetime) -> TaskState:
        if not all(s.ended and not s.retry_pending for s in sessions):
            started = any(s.ended or s.stage != SessionStage.QUEUED for s in sessions)
            return TaskState.RUNNING if started else TaskState.PENDING
        if self._missing_evaluations(accepted, sessions) == 0:
            return TaskState.DONE
        last_end = max((s.ended_at for s in sessions if s.ended_at is not None), default=now)
        if now - last_end >= timedelta(seconds=self.evaluation_wait_s):
            return TaskState.DONE
        return TaskState.EVALUATING

    def status(self, task_id: str, now: datetime | None = None) -> TaskStatus | None:
        """The task's status, or None if no such task was accepted."""
        accepted = self._tasks.get(task_id)
        if accepted is None:
            return None
        now = now or _utcnow()
        sessions = self.sessions(task_id)
        state = self._state(accepted, sessions, now)
        stages: dict[str, int] = {}
        for s in sessions:
            key = "ended" if s.ended else s.stage.value
            stages[key] = stages.get(key, 0) + 1
        request = accepted.request
        return TaskStatus(
            task_id=task_id, state=state, accepted_at=accepted.occurred_at, num_samples=len(sessions),
            harness=request.agent.harness, evaluator=request.evaluator.name if request.evaluator else None,
            stages=stages, sessions=sessions,
            result=self._result(accepted, sessions, now) if state == TaskState.DONE else None,
        )

    def _result(self, accepted: TaskAccepted, sessions: list[SessionStatusView], now: datetime) -> TaskResult:
        request = accepted.request
        rewards = [s.reward for s in sessions if s.reward is not None]
        # Evaluations carry no time of their own: the last session end stands for the finish.
        finished = max((s.ended_at for s in sessions if s.ended_at is not None), default=now)
        return TaskResult(
            task_id=accepted.task_id, group_id=request.group_id, policy_version=request.policy_version,
            evaluator=request.evaluator.name if request.evaluator else None,
            accepted_at=accepted.occurred_at, finished_at=finished,
            complete=self._missing_evaluations(accepted, sessions) == 0,
            sessions=sessions, mean_reward=sum(rewards) / len(rewards) if rewards else None,
        )

    def summaries(self, now: datetime | None = None) -> list[TaskSummary]:
        now = now or _utcnow()
        out = []
        for task_id, accepted in self._tasks.items():
            sessions = self.sessions(task_id)
            out.append(TaskSummary(task_id=task_id, state=self._state(accepted, sessions, now),
                                   accepted_at=accepted.occurred_at, num_samples=len(sessions),
                                   ended=sum(1 for s in sessions if s.ended and not s.retry_pending)))
        return out

    def take_finished(self, now: datetime | None = None) -> list[TaskResult]:
        """Results of tasks that became done since the last call (each task once)."""
        now = now or _utcnow()
        out = []
        for task_id, accepted in self._tasks.items():
            if task_id in self._reported:
                continue
            sessions = self.sessions(task_id)
            if self._state(accepted, sessions, now) == TaskState.DONE:
                self._reported.add(task_id)
                out.append(self._result(accepted, sessions, now))
        return out


class StatusFeed:
    """Keeps a :class:`RolloutView` up to date from Kafka; calls ``on_finished`` once per done task.

    Done tasks are reported only after the feed has caught up with the log, so that a restarted server
    does not mistake a task whose evaluations it has not read yet for one that lacks them.
    """

    def __init__(self, kafka: KafkaSettings, view: RolloutView, on_finished: Callable[[TaskResult], None],
                 *, count_completions: bool = True, poll_ms: int = 200,
                 on_retries: Callable[[list[SessionSpec]], Awaitable[None]] | None = None) -> None:
        self.kafka = kafka
        self.view = view
        self.on_finished = on_finished
        self.on_retries = on_retries
        self.count_completions = count_completions
        self.poll_ms = poll_ms
        self.caught_up = asyncio.Event()
        self._events_caught_up = asyncio.Event()
        self._completions_caught_up = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._forever(self._follow_events), name="rollout-status"))
        if self.count_completions:
            self._tasks.append(asyncio.create_task(self._forever(self._count_completions),
                                                   name="rollout-completions"))
        else:
            self._completions_caught_up.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _forever(self, follow: Callable[[], object]) -> None:
        while True:
            try:
                await follow()  # type: ignore[misc]
            except asyncio.CancelledError:
                raise
            except TransportError as exc:
                logger.warning("rollout status lost Kafka (%s); retrying in 2 s", exc)
                await asyncio.sleep(2)
            except Exception:  # a bug must not silently stop the view from following the log
                logger.exception("rollout status reader failed; restarting it in 2 s")
                await asyncio.sleep(2)

    def _update_caught_up(self) -> None:
        if self._events_caught_up.is_set() and self._completions_caught_up.is_set():
            self.caught_up.set()

    async def _follow_events(self) -> None:
        async with EventConsumer(self.kafka, list(STATUS_TOPICS), group_id=None, service="rollout-status",
                                 dead_letters=False) as consumer:
            while True:
                for received in await consumer.getmany(timeout_ms=self.poll_ms):
                    self.view.apply(received.event)
                if not self._events_caught_up.is_set() and await consumer.lag() == 0:
                    self._events_caught_up.set()
                    self._update_caught_up()
                if self.caught_up.is_set():
                    if self.on_retries is not None and (retries := self.view.take_retries()):
                        await self.on_retries(retries)
                    for result in self.view.take_finished():
                        self.on_finished(result)

    async def _count_completions(self) -> None:
        """Count records per session on `completions` from their keys and headers, without decoding."""
        async with EventConsumer(self.kafka, [Topic.COMPLETIONS], group_id=None, service="rollout-completions",
                                 dead_letters=False) as consumer:
            self.view.reset_completion_counts()
            while True:
                for record in await consumer.getmany_raw(timeout_ms=self.poll_ms):
                    headers = dict(record.headers)
                    if record.key is not None and headers.get(HEADER_EVENT_TYPE) == b"completion":
                        self.view.count_completions(record.key.decode("utf-8", "replace"))
                if not self._completions_caught_up.is_set() and await consumer.lag() == 0:
                    self._completions_caught_up.set()
                    self._update_caught_up()
