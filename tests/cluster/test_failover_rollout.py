"""A broker dies mid-rollout and nothing is lost: the main job on the three-node cluster over the
stand-in engine, many short `command` harness sessions, the node leading the most `completions`
partitions SIGKILLed mid-run and started again later (bench/failover.py runs the same rollout and prints
its figures). Compared with a fault-free run of the same tasks: every call a harness saw answered has
exactly one recorded completion, every ended session exactly one trajectory, every task exactly one group,
and a trainer feed reading throughout gets every group once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.failover import Fault, Outcome, run_rollout
from deploy.kafka_cluster import KafkaCluster

pytestmark = pytest.mark.kafka

TASKS, SAMPLES, CALLS = 4, 2, 4
# What must be equal to the fault-free run: the counts of calls, sessions, tasks and their outputs.
COUNTS = ("answered", "unanswered", "recorded", "sessions_ended", "tasks", "feed_groups", "job_exit_code")


def _assert_whole(outcome: Outcome) -> None:
    assert outcome.answered == TASKS * SAMPLES * CALLS and outcome.unanswered == 0, outcome
    assert outcome.lost == 0 and outcome.duplicated_completions == 0, outcome
    assert outcome.sessions_ended == TASKS * SAMPLES, outcome
    assert outcome.missing_trajectories == 0 and outcome.duplicated_trajectories == 0, outcome.details
    assert outcome.tasks == TASKS and outcome.missing_groups == 0 and outcome.duplicated_groups == 0, outcome
    assert outcome.job_exit_code == 0, outcome
    # The trainer feed read every group once, resuming on the new leaders and coordinator.
    assert outcome.feed_groups == TASKS and outcome.feed_repeated_groups == 0, outcome


@pytest.fixture(scope="module")
def fault_free(kafka_cluster: KafkaCluster, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    outcome = run_rollout(kafka_cluster, tmp_path_factory.mktemp("fault-free"), tasks=TASKS, samples=SAMPLES,
                          calls=CALLS, fault=None)
    _assert_whole(outcome)
    return outcome


def test_a_killed_leader_loses_and_repeats_nothing(kafka_cluster: KafkaCluster, fault_free: Outcome,
                                                   tmp_path: Path) -> None:
    outcome = run_rollout(kafka_cluster, tmp_path, tasks=TASKS, samples=SAMPLES, calls=CALLS,
                          fault=Fault(kill_after=0.3, down_s=12))
    assert outcome.killed_node in (1, 2, 3), "the fault was never injected: the run ended first"
    _assert_whole(outcome)
    assert {k: getattr(outcome, k) for k in COUNTS} == {k: getattr(fault_free, k) for k in COUNTS}


def test_a_trajectory_worker_killed_while_the_broker_is_away(kafka_cluster: KafkaCluster, fault_free: Outcome,
                                                             tmp_path: Path) -> None:
    """Two trajectory workers share the partitions; one is SIGKILLed during the node's absence: the other
    takes its partitions over and builds each of their sessions' trajectory once."""
    outcome = run_rollout(kafka_cluster, tmp_path, tasks=TASKS, samples=SAMPLES, calls=CALLS,
                          fault=Fault(kill_after=0.3, down_s=12, kill_worker=True))
    assert outcome.killed_node in (1, 2, 3) and outcome.killed_worker, outcome
    _assert_whole(outcome)
    assert {k: getattr(outcome, k) for k in COUNTS} == {k: getattr(fault_free, k) for k in COUNTS}
