"""The groups worker's logic without Kafka: when a task's group is due, and what goes into it.

These pin the rules the worker test can only show once each: the deadline fraction, abandonment, the
restart delay, late facts after emission, and a sample whose evaluation never came (flagged, not zero).
"""

from __future__ import annotations

import pytest

from processors.groups.assembly import (
    FactError,
    State,
    TaskFacts,
    TaskState,
    build_group,
    decide,
    evaluation_fact,
    group_event_id,
    trajectory_fact,
)
from schemas.sessions import FailureKind

T0 = 1_000_000.0


def task_state(n: int = 4, deadline_at: float = T0 + 100) -> TaskState:
    return TaskState(TaskFacts("t", [f"s{i}" for i in range(n)], n, deadline_at, "tests", "g", "v1"))


def traj(session_id: str, status: str = "completed", failure: str | None = None, partial: bool = False) -> dict:
    return trajectory_fact({"event_id": f"tr-{session_id}", "session_id": session_id, "task_id": "t",
                            "session_status": status, "failure": failure, "partial": partial})


def ev(session_id: str, reward: float | None, evaluator: str = "tests", status: str = "ok") -> dict:
    return evaluation_fact({"event_id": f"ev-{session_id}-{evaluator}", "session_id": session_id, "task_id": "t",
                            "evaluator": evaluator, "status": status, "reward": reward})


def decide_at(state: TaskState, now: float, *, min_fraction: float = 0.5, not_before: float = 0.0) -> State | None:
    return decide(state, now=now, default_evaluator="session_completed", min_fraction=min_fraction,
                  abandon_s=500, not_before=not_before)


def test_all_in_emits_at_once_and_only_the_tasks_evaluator_counts() -> None:
    state = task_state(2)
    for fact in (traj("s0"), ev("s0", 1.0), traj("s1"), ev("s1", 0.0, evaluator="session_completed")):
        state.add(fact)
    assert decide_at(state, T0) is None  # s1 has no `tests` evaluation yet
    state.add(ev("s1", 0.0))
    assert decide_at(state, T0) is State.EMITTED


def test_failed_sessions_need_no_evaluation() -> None:
    state = task_state(2)
    state.add(traj("s0", "timeout", "policy"))
    state.add(traj("s1", "error", "infrastructure"))
    assert decide_at(state, T0) is State.EMITTED


def test_deadline_fraction_and_abandonment() -> None:
    state = task_state(4)
    state.add(traj("s0"))
    state.add(ev("s0", 1.0))
    assert decide_at(state, T0 + 99) is None
    assert decide_at(state, T0 + 101) is None  # 1 of 4 < 0.5
    assert decide_at(state, T0 + 101, min_fraction=0.25) is State.EMITTED
    assert decide_at(state, T0 + 601) is State.ABANDONED
    state.add(traj("s1", "error", "policy"))
    assert decide_at(state, T0 + 101) is State.EMITTED  # 2 of 4
    # After a restart, no deadline fires before the log has had time to replay.
    assert decide_at(state, T0 + 101, not_before=T0 + 200) is None


def test_a_closed_task_ignores_late_facts_and_keeps_only_its_verdict() -> None:
    state = task_state(1)
    state.add(traj("s0"))
    state.state, state.group_event_id = State.EMITTED, group_event_id("t")
    closed = TaskState.loads(state.closed().dumps())
    assert closed.state is State.EMITTED and closed.task is None and closed.trajectories == {}
    assert closed.add(ev("s0", 1.0)) is False
    assert decide_at(closed, T0 + 10_000) is None


def test_group_at_deadline_flags_what_is_missing() -> None:
    state = task_state(4)
    state.add(traj("s0")), state.add(ev("s0", 1.0))
    state.add(traj("s1")), state.add(ev("s1", 0.0))
    state.add(traj("s2"))  # completed, but the evaluator never answered
    state.add(ev("s3", 1.0))  # an evaluation without its trajectory
    state = TaskState.loads(state.dumps())
    group = build_group(state, default_evaluator="x", estimator="leave_one_out", eps=1e-6)
    assert group.event_id == group_event_id("t") and group.task_id == "t" and group.group_id == "g"
    assert not group.complete and group.evaluator == "tests" and group.estimator == "leave_one_out"
    assert [s.advantage for s in group.samples] == [1.0, -1.0, None, None]
    assert group.samples[2].trajectory_id == "tr-s2" and group.samples[2].failure is FailureKind.INFRASTRUCTURE
    assert group.samples[3].trajectory_id is None


def test_an_errored_evaluation_is_an_infrastructure_sample() -> None:
    """The evaluator crashing says nothing of the policy: no advantage, out of the baseline."""
    state = task_state(3)
    for i, reward in enumerate([1.0, 0.0]):
        state.add(traj(f"s{i}")), state.add(ev(f"s{i}", reward))
    state.add(traj("s2"))
    state.add(evaluation_fact({"event_id": "e", "session_id": "s2", "evaluator": "tests", "status": "error",
                               "error": "docker died"}))
    assert decide_at(state, T0) is State.EMITTED
    group = build_group(state, default_evaluator="x", estimator="grpo", eps=0.0)
    assert group.samples[2].advantage is None and not group.samples[2].in_baseline
    assert group.samples[2].failure is FailureKind.INFRASTRUCTURE and group.usable == 2


def test_a_resubmitted_sample_waits_for_its_next_session_and_stands_for_it() -> None:
    """An infrastructure failure with resubmissions left is not in: the group waits for the sample's next
    session (``<first id>-retry<n>``) and then carries that session in the sample's place."""
    state = TaskState(TaskFacts("t", ["s0", "s1"], 2, T0 + 100, "tests", "g", "v1", max_retries=2))
    state.add(traj("s0")), state.add(ev("s0", 1.0))
    state.add(traj("s1", status="error", failure="infrastructure"))
    assert decide_at(state, T0) is None  # s1's resubmission is coming
    state.add(traj("s1-retry1", status="error", failure="infrastructure"))
    assert decide_at(state, T0) is None
    state.add(traj("s1-retry2")), state.add(ev("s1-retry2", 0.0))
    assert decide_at(state, T0) is State.EMITTED
    group = build_group(state, default_evaluator="x", estimator="grpo", eps=0.0, min_usable=1.0)
    assert [(s.session_id, s.attempt) for s in group.samples] == [("s0", 0), ("s1-retry2", 2)]
    assert group.usable == 2 and not group.insufficient and group.baseline_mean == 0.5


def test_a_group_short_of_usable_samples_is_marked_insufficient() -> None:
    """Resubmissions spent, one sample of two still an infrastructure failure, one unknown: under the
    minimum usable share, the group is emitted marked insufficient (the feed leaves it out)."""
    state = TaskState(TaskFacts("t", ["s0", "s1", "s2"], 3, T0 + 100, "tests", "g", "v1", max_retries=1))
    state.add(traj("s0")), state.add(ev("s0", 1.0))
    state.add(traj("s1", status="error", failure="infrastructure"))
    state.add(traj("s1-retry1", status="error", failure="infrastructure"))
    state.add(traj("s2", status="error", failure="unknown"))
    assert decide_at(state, T0) is State.EMITTED
    group = build_group(state, default_evaluator="x", estimator="grpo", eps=0.0, min_usable=0.5)
    assert group.usable == 1 and group.insufficient
    assert [s.advantage for s in group.samples[1:]] == [None, None]


@pytest.mark.parametrize("document", [
    {"event_id": "e", "session_id": "s", "session_status": "exploded"},
    {"event_id": "e", "session_id": "s", "failure": "cosmic rays"},
    {"session_id": "s"},
])
def test_bad_trajectory_documents_are_refused(document: dict) -> None:
    with pytest.raises(FactError):
        trajectory_fact(document)


def test_bad_evaluation_documents_are_refused() -> None:
    with pytest.raises(FactError, match="reward"):
        evaluation_fact({"event_id": "e", "session_id": "s", "evaluator": "tests", "reward": "1"})
    with pytest.raises(FactError, match="without a reward"):
        evaluation_fact({"event_id": "e", "session_id": "s", "evaluator": "tests"})


def test_the_groups_version_range_spans_its_samples_trajectories() -> None:
    """a group carries the oldest and newest weight version of its samples' trajectories (a failed
    sample's too, and facts stored before trajectories carried ranges count as none)."""
    state = task_state(4)
    ranges = [{"oldest": 3, "newest": 4}, {"oldest": 2, "newest": 2}, None, {"oldest": 5, "newest": 6}]
    for i, versions in enumerate(ranges):
        fact = trajectory_fact({"event_id": f"tr-s{i}", "session_id": f"s{i}", "task_id": "t",
                                "session_status": "completed" if i != 3 else "error",
                                "failure": None if i != 3 else "policy", "policy_versions": versions})
        state.add(fact)
        state.add(ev(f"s{i}", float(i % 2)))
    del state.trajectories["s2"]["policy_versions"]  # as a fact stored by the worker before policy versions were recorded
    state = TaskState.loads(state.dumps())
    group = build_group(state, default_evaluator="x", estimator="grpo", eps=1e-6)
    assert group.policy_versions is not None
    assert (group.policy_versions.oldest, group.policy_versions.newest) == (2, 6)
    assert group.policy_version == "v1"  # the task's claim string, unchanged
    unversioned = task_state(1)
    unversioned.add(traj("s0")), unversioned.add(ev("s0", 1.0))
    assert build_group(unversioned, default_evaluator="x", estimator="grpo", eps=1e-6).policy_versions is None


def test_a_malformed_version_range_is_refused() -> None:
    with pytest.raises(FactError, match="policy_versions"):
        trajectory_fact({"event_id": "e", "session_id": "s", "policy_versions": {"oldest": 5, "newest": 2}})
