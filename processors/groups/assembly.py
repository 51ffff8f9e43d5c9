"""Assembling a task's group: per-task state as plain values, facts in, a Group out (no Faust in here).

The groups worker (processors/groups/app.py) keeps one :class:`TaskState` per task, keyed by task id, in a
table co-partitioned with ``tasks``. Into it go: the task (from ``task.accepted``: session ids, sample
count, deadline, evaluator), and per session the facts the worker's first stage forwards from
``trajectories`` and ``evaluations`` (:func:`trajectory_fact`, :func:`evaluation_fact`: a few fields, never
the token arrays). A sample is *in* when its trajectory is there and either the session failed (its reward
cannot matter: see advantages.py) or the task's evaluator has scored it. The group is emitted when every
sample is in, or at the deadline when at least ``min_fraction`` are (``complete: false``; the samples not
in are flagged as infrastructure failures, advantage None, so a trainer can resubmit them).

The group's ``policy_versions`` is the range of engine weight versions over its samples' trajectories (each
trajectory fact carries its trajectory's range; failed samples' trajectories count too, they are part of
the group), None when no trajectory has one. ``policy_version`` stays the task's claim string.

A sample whose session failed for the infrastructure is resubmitted by the rollout server as a new
session (``schemas.sessions.retry_session_id``: its id names the first session and the attempt), up to the
task's ``max_retries``; its facts arrive under the task like the first session's. A sample stands for its
latest session that has a trajectory, and is not in while that session failed for the infrastructure with
resubmissions left (its next session is coming). The deadline leaves room for them: acceptance time plus
``timeout_s`` for each possible session, plus the grace.

The group's event id depends only on the task id: whatever replays, restarts or deadline races make the
worker emit a task's group twice, readers see one event id and keep one group.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from pydantic import ValidationError

from processors.errors import FactError
from processors.groups.advantages import Estimator, SampleOutcome, compute_advantages, usable_count
from schemas.groups import Group
from schemas.policy import PolicyRange
from schemas.sessions import FailureKind, SessionStatus, retry_session_id
from schemas.tasks import TaskAccepted

_GROUP_NAMESPACE = uuid.UUID("0f5c3e0a-57a4-4d0e-8a8e-6c1b7f6d2e11")


def group_event_id(task_id: str) -> str:
    """The one event id a task's group ever has."""
    return uuid.uuid5(_GROUP_NAMESPACE, f"group\x00{task_id}").hex


def _text(document: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = document.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise FactError(f"{name} is missing or not a non-empty string")
    return value


def _policy_versions(document: dict[str, Any]) -> dict[str, int] | None:
    """The trajectory's version range as a plain dict (it is stored in the task's state), or None."""
    value = document.get("policy_versions")
    if value is None:
        return None
    try:
        return PolicyRange.model_validate(value).model_dump()
    except ValidationError as exc:
        raise FactError(f"policy_versions {value!r} is not a version range: {exc.errors()[0]['msg']}") from None


def trajectory_fact(document: dict[str, Any]) -> dict[str, Any]:
    """What a group needs from a trajectory document (envelope already checked)."""
    status = document.get("session_status")
    failure = document.get("failure")
    if status is not None and status not in {s.value for s in SessionStatus}:
        raise FactError(f"session_status {status!r} is not a session status")
    if failure is not None and failure not in {f.value for f in FailureKind}:
        raise FactError(f"failure {failure!r} is not a failure kind")
    return {"kind": "trajectory", "session_id": _text(document, "session_id"), "task_id": _text(document, "task_id",
            required=False), "event_id": _text(document, "event_id"), "status": status, "failure": failure,
            "partial": bool(document.get("partial", False)), "policy_version": document.get("policy_version"),
            "policy_versions": _policy_versions(document)}


def evaluation_fact(document: dict[str, Any]) -> dict[str, Any]:
    """What a group needs from an evaluation document (envelope already checked)."""
    status = document.get("status", "ok")
    reward = document.get("reward")
    if status not in ("ok", "error"):
        raise FactError(f"status {status!r} is not 'ok' or 'error'")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise FactError(f"reward {reward!r} is not a number")
    if status == "ok" and reward is None:
        raise FactError("an 'ok' evaluation without a reward")
    return {"kind": "evaluation", "session_id": _text(document, "session_id"),
            "task_id": _text(document, "task_id", required=False), "event_id": _text(document, "event_id"),
            "evaluator": _text(document, "evaluator"), "status": status,
            "reward": float(reward) if reward is not None else None}


@dataclass(slots=True)
class TaskFacts:
    """The task as accepted: its sessions, deadline (epoch seconds) and reward evaluator."""

    task_id: str
    session_ids: list[str]
    num_samples: int
    deadline_at: float
    evaluator: str | None
    group_id: str | None
    policy_version: str | None
    max_retries: int = 0

    @classmethod
    def of(cls, accepted: TaskAccepted, grace_s: float) -> TaskFacts:
        request = accepted.request
        retries = request.max_retries or 0
        return cls(accepted.task_id, list(accepted.session_ids), request.num_samples,
                   accepted.occurred_at.timestamp() + request.timeout_s * (1 + retries) + grace_s,
                   request.evaluator.name if request.evaluator else None, request.group_id, request.policy_version,
                   retries)


class State(str, enum.Enum):
    OPEN = "open"
    EMITTED = "emitted"
    ABANDONED = "abandoned"


@dataclass(slots=True)
class TaskState:
    """Everything the worker holds for one task (a few hundred bytes per sample)."""

    task: TaskFacts | None = None
    trajectories: dict[str, dict[str, Any]] = field(default_factory=dict)  # session id -> trajectory fact
    evaluations: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # session -> evaluator -> fact
    state: State = State.OPEN
    group_event_id: str | None = None

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes) -> TaskState:
        data = orjson.loads(raw)
        task = TaskFacts(**data["task"]) if data.get("task") else None
        return cls(task, data.get("trajectories", {}), data.get("evaluations", {}), State(data["state"]),
                   data.get("group_event_id"))

    def closed(self) -> TaskState:
        """What is kept after emission or abandonment: the verdict only (late facts are then ignored)."""
        return TaskState(None, {}, {}, self.state, self.group_event_id)

    def add(self, fact: dict[str, Any]) -> bool:
        """Take a trajectory or evaluation fact in; False if the task is closed (a late fact)."""
        if self.state is not State.OPEN:
            return False
        session_id = fact["session_id"]
        if fact["kind"] == "trajectory":
            self.trajectories[session_id] = fact
        elif fact["kind"] == "evaluation":
            self.evaluations.setdefault(session_id, {})[fact["evaluator"]] = fact
        else:
            raise FactError(f"unknown fact kind {fact['kind']!r}")
        return True

    def evaluator(self, default: str) -> str:
        """Whose rewards count: the task's evaluator, else the worker's default."""
        return (self.task.evaluator if self.task else None) or default

    def latest_attempt(self, session_id: str) -> tuple[str, int]:
        """The sample's latest session that has a trajectory (its first session when none has):
        ``(session id, attempt)``."""
        retries = self.task.max_retries if self.task is not None else 0
        for attempt in range(retries, 0, -1):
            retry = retry_session_id(session_id, attempt)
            if retry in self.trajectories:
                return retry, attempt
        return session_id, 0

    def outcome(self, first_session_id: str, evaluator: str) -> SampleOutcome:
        """The sample as it stands (missing parts marked missing), by its latest session."""
        session_id, attempt = self.latest_attempt(first_session_id)
        trajectory = self.trajectories.get(session_id)
        evaluation = self.evaluations.get(session_id, {}).get(evaluator)
        if trajectory is None:
            return SampleOutcome(session_id, reward=evaluation["reward"] if evaluation else None, missing=True,
                                 attempt=attempt)
        status = SessionStatus(trajectory["status"]) if trajectory["status"] else None
        failure = FailureKind(trajectory["failure"]) if trajectory["failure"] else None
        retries = self.task.max_retries if self.task is not None else 0
        resubmitted = failure is FailureKind.INFRASTRUCTURE and not trajectory["partial"] and attempt < retries
        return SampleOutcome(
            session_id, reward=evaluation["reward"] if evaluation else None, status=status, failure=failure,
            trajectory_id=trajectory["event_id"], partial=trajectory["partial"],
            evaluation_error=evaluation is not None and evaluation["status"] == "error",
            # A scoreable session the evaluator has not answered for, or one whose next session is coming:
            # not in (yet).
            missing=resubmitted or (evaluation is None and status is SessionStatus.COMPLETED and failure is None
                                    and not trajectory["partial"]),
            attempt=attempt)

    def is_in(self, session_id: str, evaluator: str) -> bool:
        """Whether the sample's facts are complete (see the module docstring)."""
        return not self.outcome(session_id, evaluator).missing

    def count_in(self, evaluator: str) -> int:
        assert self.task is not None
        return sum(self.is_in(s, evaluator) for s in self.task.session_ids)

    def all_in(self, evaluator: str) -> bool:
        return self.task is not None and self.count_in(evaluator) == len(self.task.session_ids)


def decide(state: TaskState, *, now: float, default_evaluator: str, min_fraction: float, abandon_s: float,
           not_before: float) -> State | None:
    """What to do with an open task now: EMITTED (emit its group), ABANDONED (drop it) or None (wait).

    ``not_before``: no deadline fires before it (after a restart, the log is replayed first).
    """
    if state.state is not State.OPEN or state.task is None:
        return None
    evaluator = state.evaluator(default_evaluator)
    if state.all_in(evaluator):
        return State.EMITTED
    if now < max(state.task.deadline_at, not_before):
        return None
    if state.count_in(evaluator) >= max(1e-9, min_fraction) * len(state.task.session_ids):
        return State.EMITTED
    if now >= max(state.task.deadline_at + abandon_s, not_before):
        return State.ABANDONED
    return None


def samples_policy_range(state: TaskState, session_ids: list[str]) -> PolicyRange | None:
    """The range of weight versions over these sessions' trajectories (facts stored before ranges were
    carried have none); None when no trajectory has one."""
    ranges = [PolicyRange.model_validate(fact["policy_versions"]) for session_id in session_ids
              if (fact := state.trajectories.get(session_id)) is not None and fact.get("policy_versions")]
    if not ranges:
        return None
    merged = ranges[0]
    for other in ranges[1:]:
        merged = merged.merged(other)
    return merged


def build_group(state: TaskState, *, default_evaluator: str, estimator: Estimator, eps: float,
                min_usable: float = 0.0) -> Group:
    """The task's Group event from its state (every sample of the task, in the task's order, each by its
    latest session); ``insufficient`` when fewer than ``min_usable`` of the samples are usable."""
    task = state.task
    assert task is not None, "a group needs its task"
    evaluator = state.evaluator(default_evaluator)
    outcomes = [state.outcome(session_id, evaluator) for session_id in task.session_ids]
    result = compute_advantages(outcomes, estimator=estimator, eps=eps)
    usable = usable_count(outcomes)
    policy = task.policy_version or next(
        (t["policy_version"] for t in state.trajectories.values() if t.get("policy_version")), None)
    return Group(event_id=group_event_id(task.task_id), task_id=task.task_id, group_id=task.group_id,
                 policy_version=policy, policy_versions=samples_policy_range(state, [o.session_id for o in outcomes]),
                 samples=result.samples, baseline_mean=result.baseline_mean,
                 baseline_std=result.baseline_std, complete=not any(o.missing for o in outcomes),
                 no_signal=result.no_signal, evaluator=evaluator, estimator=estimator, usable=usable,
                 insufficient=usable < min_usable * len(outcomes))


__all__ = ["FactError", "State", "TaskFacts", "TaskState", "build_group", "decide", "evaluation_fact",
           "group_event_id", "samples_policy_range", "trajectory_fact"]
