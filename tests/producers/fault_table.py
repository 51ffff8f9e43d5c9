"""The fault-injection suites' shared measure: what the groups worker and the trainer feed do with a task's
ends, as one row of the fault table (tests/producers/test_fault_injection*.py).

A task's status from the rollout server (each sample's latest session and the ones it replaced) is turned
into the group the groups worker would emit from those ends, with processors.groups.assembly (the same
code; completed sessions scored 1.0), and, per sample, whether the trainer feed would train on it (an
advantage, in a group not marked insufficient). The table is printed (pytest ``-s``) and appended to
``$ROLLWIRE_FAULT_TABLE`` when set.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from processors.groups.assembly import TaskFacts, TaskState, build_group, evaluation_fact, trajectory_fact
from schemas.rollouts import SessionStatusView, TaskStatus

# A harness script's one model call (the session's OpenAI URL and key, a short reply), shared by the
# fault-injection harnesses.
HARNESS_CALL = r'''
def call():
    body = {"model": os.environ["ROLLWIRE_MODEL"], "max_tokens": 8,
            "messages": [{"role": "user", "content": os.environ["ROLLWIRE_INSTRUCTION"]}]}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        json.load(response)
'''


def free_port() -> int:
    """A port nothing listens on (for now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def group_and_feed(status: TaskStatus, min_usable: float = 0.5) -> tuple[Any, list[bool]]:
    """The group the groups worker builds from these ends (completed sessions scored 1.0) and, per
    sample, whether the trainer feed takes it."""
    task_ids = [s.retries[0].session_id if s.retries else s.session_id for s in status.sessions]
    retries = max((len(s.retries) for s in status.sessions), default=0)
    state = TaskState(TaskFacts(status.task_id, task_ids, len(task_ids), 0.0, "tests", None, None, max(retries, 1)))
    for sample in status.sessions:
        chain = [*[(r.session_id, "error", "infrastructure") for r in sample.retries],
                 (sample.session_id, sample.status.value if sample.status else None,
                  sample.failure.value if sample.failure else None)]
        for session_id, ended, failure in chain:
            state.add(trajectory_fact({"event_id": f"t-{session_id}", "session_id": session_id,
                                       "task_id": status.task_id, "session_status": ended, "failure": failure}))
            if ended == "completed":
                state.add(evaluation_fact({"event_id": f"e-{session_id}", "session_id": session_id,
                                           "task_id": status.task_id, "evaluator": "tests", "reward": 1.0}))
    group = build_group(state, default_evaluator="tests", estimator="grpo", eps=1e-6, min_usable=min_usable)
    return group, [s.advantage is not None and not group.insufficient for s in group.samples]


def fault_row(fault: str, status: TaskStatus) -> dict[str, Any]:
    """Sample 0's row: the cause of its first session, its final status and failure, its resubmissions,
    the group's usable samples and mark, and whether the feed takes it."""
    sample: SessionStatusView = status.sessions[0]
    first_cause = sample.retries[0].cause.value if sample.retries and sample.retries[0].cause else (
        sample.cause.value if sample.cause else "-")
    group, feed = group_and_feed(status)
    return {"fault": fault, "first": first_cause, "final": sample.status.value if sample.status else "-",
            "failure": sample.failure.value if sample.failure else "-", "retried": len(sample.retries),
            "usable": group.usable, "insufficient": group.insufficient, "in_feed": feed[0]}


def print_fault_table(rows: list[dict[str, Any]]) -> None:
    lines = ["| fault | cause of the first session | final status | failure | resubmissions | group usable | "
             "group insufficient | in the feed |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['fault']} | {r['first']} | {r['final']} | {r['failure']} | {r['retried']} | {r['usable']}/2 | "
              f"{'yes' if r['insufficient'] else 'no'} | {'yes' if r['in_feed'] else 'no'} |" for r in rows]
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("ROLLWIRE_FAULT_TABLE"):
        with open(os.environ["ROLLWIRE_FAULT_TABLE"], "a") as out:
            out.write(text + "\n")
