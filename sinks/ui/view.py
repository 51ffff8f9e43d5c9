"""The UI's view of the log: tasks, groups, sessions, their calls, evaluations and trajectories, bounded.

Everything here is derived from events and nothing else, so the view can be thrown away and read again
from the topics (``sinks/ui/reader.py`` does that at start). It is bounded by an approximate byte budget
(the records' own sizes): when it is over, the sessions updated least recently are dropped whole, with
their completions and trajectories, and counted in :attr:`RunView.evicted_sessions`; a page that asks
for one says it is no longer held. Tasks and groups are small and kept up to :attr:`RunView.max_tasks`.

Completions are kept as written (a v2 event may be a prompt delta): the session page resolves them with
:func:`schemas.prompt_chain.resolve_session` when it is asked for, so holding a session costs its log's
size, not the sum of its full prompts.

Runs: the main job names its tasks ``<task id>-r<run id>`` (deploy/job.py), so a run is the tasks that
share that suffix; tasks without one are under the run ``-``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime

from schemas.completions import Completion
from schemas.envelope import Event
from schemas.evaluations import Evaluation
from schemas.groups import Group
from schemas.sessions import SessionEnded, SessionSpec, SessionStage, SessionStageChanged
from schemas.tasks import TaskAccepted
from schemas.trajectories import Trajectory
from sinks.ui.settings import DEFAULT_MAX_BYTES

DEFAULT_MAX_TASKS = 10_000
NO_RUN = "-"
_RUN_SUFFIX = re.compile(r"-r([0-9]{10}[0-9a-f]{2})$")


def run_of(task_id: str | None) -> str:
    """The run a task belongs to: the main job's ``-r<run id>`` suffix of its id, else :data:`NO_RUN`."""
    match = _RUN_SUFFIX.search(task_id or "")
    return match.group(1) if match else NO_RUN


@dataclass(frozen=True, slots=True)
class StageMark:
    """A session entered ``stage`` at ``at``."""

    stage: SessionStage
    at: datetime
    node: str | None


@dataclass(slots=True)
class SessionState:
    """One session as its events describe it."""

    session_id: str
    task_id: str | None = None
    spec: SessionSpec | None = None
    stages: list[StageMark] = field(default_factory=list)
    ended: SessionEnded | None = None
    completions: dict[str, Completion] = field(default_factory=dict)  # by event id, as written
    evaluations: dict[str, Evaluation] = field(default_factory=dict)  # by evaluator (the latest)
    trajectories: dict[str, Trajectory] = field(default_factory=dict)  # by builder (the latest)
    bytes: int = 0
    first_seen: datetime | None = None

    @property
    def status(self) -> str:
        """How it ended, else the last stage it entered, else ``recording`` (calls but no lifecycle)."""
        if self.ended is not None:
            return self.ended.status.value
        if self.stages:
            return self.stages[-1].stage.value
        return "recording" if self.completions else "registered"

    def calls(self) -> list[Completion]:
        """Its completions as written, in call order."""
        return sorted(self.completions.values(), key=lambda c: (c.sequence, c.occurred_at))

    def trajectory(self) -> Trajectory | None:
        """The trajectory of the session's own builder, else the latest of any builder."""
        builder = self.spec.builder if self.spec is not None else None
        if builder in self.trajectories:
            return self.trajectories[builder]
        latest = sorted(self.trajectories.values(), key=lambda t: t.occurred_at)
        return latest[-1] if latest else None

    def reward(self) -> float | None:
        evaluator = self.spec.evaluator.name if self.spec is not None and self.spec.evaluator else None
        chosen = self.evaluations.get(evaluator or "") or next(iter(self.evaluations.values()), None)
        return chosen.reward if chosen is not None else None


@dataclass(slots=True)
class TaskState:
    """One task: as accepted, its sessions and its latest group."""

    task_id: str
    accepted: TaskAccepted | None = None
    group: Group | None = None
    session_ids: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return run_of(self.task_id)


class RunView:
    """The bounded view the pages are rendered from; :meth:`apply` is the only way in."""

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES, max_tasks: int = DEFAULT_MAX_TASKS) -> None:
        if max_bytes < 1024 * 1024:
            raise ValueError(f"max_bytes {max_bytes}: give the view at least 1 MiB (ROLLWIRE_UI_MAX_BYTES)")
        self.max_bytes, self.max_tasks = max_bytes, max_tasks
        self.sessions: OrderedDict[str, SessionState] = OrderedDict()  # least recently updated first
        self.tasks: OrderedDict[str, TaskState] = OrderedDict()
        self.bytes = 0
        self.events = 0
        self.evicted_sessions = 0
        self.version = 0
        """Grows with every event applied: live pages reload when it moves."""
        self.caught_up = False
        """The reader has read what was on the log when it started."""

    def apply(self, event: Event, size: int) -> None:
        """Take one event read from the log (``size``: its record's bytes, what holding it costs)."""
        self.events += 1
        self.version += 1
        if isinstance(event, TaskAccepted):
            task = self._task(event.task_id)
            task.accepted = event
            for listed in event.session_ids:
                if listed not in task.session_ids:
                    task.session_ids.append(listed)
            return
        if isinstance(event, Group):
            self._task(event.task_id).group = event
            return
        found = getattr(event, "session_id", None)
        if not isinstance(found, str):
            return
        session_id = found
        session = self._session(session_id)
        kept = True
        if isinstance(event, SessionSpec):
            session.spec = event
        elif isinstance(event, SessionStageChanged):
            session.stages.append(StageMark(event.stage, event.occurred_at, event.node))
            session.stages.sort(key=lambda mark: mark.at)
        elif isinstance(event, SessionEnded):
            session.ended = event
        elif isinstance(event, Completion):
            kept = event.event_id not in session.completions
            session.completions[event.event_id] = event
        elif isinstance(event, Evaluation):
            session.evaluations[event.evaluator] = event
        elif isinstance(event, Trajectory):
            old = session.trajectories.get(event.builder)
            if old is not None and old.occurred_at > event.occurred_at:
                kept = False
            else:
                session.trajectories[event.builder] = event
        else:
            kept = False
        task_id = getattr(event, "task_id", None)
        if isinstance(task_id, str) and task_id:
            session.task_id = session.task_id or task_id
            task = self._task(task_id)
            if session_id not in task.session_ids:
                task.session_ids.append(session_id)
        if session.first_seen is None:
            session.first_seen = event.occurred_at
        if kept:
            session.bytes += size
            self.bytes += size
        self._evict()

    def _session(self, session_id: str) -> SessionState:
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = SessionState(session_id)
        else:
            self.sessions.move_to_end(session_id)
        return session

    def _task(self, task_id: str) -> TaskState:
        task = self.tasks.get(task_id)
        if task is None:
            task = self.tasks[task_id] = TaskState(task_id)
            while len(self.tasks) > self.max_tasks:
                self.tasks.popitem(last=False)
        return task

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and len(self.sessions) > 1:
            _, dropped = self.sessions.popitem(last=False)
            self.bytes -= dropped.bytes
            self.evicted_sessions += 1

    # -- what the pages ask -------------------------------------------------------------------------

    def runs(self) -> dict[str, list[TaskState]]:
        """Tasks per run id, newest run first (run ids are timestamps)."""
        out: dict[str, list[TaskState]] = {}
        for task in self.tasks.values():
            out.setdefault(task.run_id, []).append(task)
        return dict(sorted(out.items(), key=lambda item: item[0], reverse=True))  # "-" sorts last

    def sessions_of(self, task: TaskState) -> list[SessionState]:
        """The task's sessions the view holds, by sample index."""
        held = [self.sessions[s] for s in task.session_ids if s in self.sessions]
        return sorted(held, key=lambda s: (s.spec.sample_index if s.spec else 0, s.session_id))

    def loose_sessions(self) -> list[SessionState]:
        """Sessions without a task (``rollwire session new``), newest first."""
        return [s for s in reversed(self.sessions.values()) if not s.task_id]
