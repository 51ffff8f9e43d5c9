"""Resubmission of infrastructure failures by the rollout server's view (producers/rollout/status.py),
without Kafka: which ends are resubmitted, how the new session is linked, and when the task is done."""

from __future__ import annotations

from producers.rollout.expand import expand
from producers.rollout.status import RolloutView
from schemas.attribution import Cause, kind_of
from schemas.rollouts import TaskState
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.tasks import AgentSpec, TaskRequest


def _task(samples: int = 2, max_retries: int | None = None) -> tuple[RolloutView, list[SessionSpec]]:
    view = RolloutView(evaluation_wait_s=0)
    request = TaskRequest(task_id="t1", instruction="do it", num_samples=samples, max_retries=max_retries,
                          agent=AgentSpec(harness="command", command="true"))
    accepted, specs = expand(request, max_retries=2)
    for spec in specs:
        view.apply(spec)
    view.apply(accepted)
    return view, specs


def _end(session_id: str, cause: Cause | None) -> SessionEnded:
    status = SessionStatus.COMPLETED if cause is None else SessionStatus.ERROR
    return SessionEnded(session_id=session_id, task_id="t1", status=status,
                        failure=kind_of(cause) if cause else None, cause=cause)


def test_an_infrastructure_failure_is_resubmitted_as_a_linked_session_until_the_limit() -> None:
    view, specs = _task()
    view.apply(_end(specs[0].session_id, None))
    view.apply(_end(specs[1].session_id, Cause.HARNESS_CRASHED))
    assert view.task_state("t1") is TaskState.RUNNING  # a resubmission is pending
    [retry] = view.take_retries()
    assert (retry.session_id, retry.attempt, retry.retry_of, retry.sample_index, retry.task_id) == (
        "t1-s1-retry1", 1, "t1-s1", 1, "t1")
    assert retry.api_key != specs[1].api_key and retry.instruction == specs[1].instruction
    view.apply(retry)
    assert view.take_retries() == []  # written once
    view.apply(_end(retry.session_id, Cause.SANDBOX_KILLED))
    [second] = view.take_retries()
    assert (second.session_id, second.retry_of) == ("t1-s1-retry2", "t1-s1-retry1")
    view.apply(second)
    view.apply(_end(second.session_id, Cause.RUNTIME_INIT))
    assert view.take_retries() == []  # the limit (2) is reached
    sample = view.sessions("t1")[1]
    assert sample.session_id == "t1-s1-retry2" and sample.attempt == 2 and not sample.retry_pending
    assert [(r.session_id, r.cause) for r in sample.retries] == [("t1-s1", Cause.HARNESS_CRASHED),
                                                                 ("t1-s1-retry1", Cause.SANDBOX_KILLED)]
    assert view.task_state("t1") is TaskState.DONE


def test_policy_and_unknown_failures_are_not_resubmitted() -> None:
    view, specs = _task()
    view.apply(_end(specs[0].session_id, Cause.AGENT_FAILED))
    view.apply(_end(specs[1].session_id, Cause.UNKNOWN))
    assert view.take_retries() == []
    assert view.task_state("t1") is TaskState.DONE


def test_a_task_that_says_no_retries_gets_none() -> None:
    view, specs = _task(samples=1, max_retries=0)
    view.apply(_end(specs[0].session_id, Cause.HARNESS_MISSING))
    assert view.take_retries() == [] and view.task_state("t1") is TaskState.DONE
