"""The groups worker, a Faust app: trajectories + evaluations + tasks in, one Group per task out.

Top to bottom: settings, the app, topics, the table, the two agents, the timer, the health page. The logic
is in processors/groups/assembly.py (state, readiness, the Group) and advantages.py (the arithmetic).
Run it with ``rollwire groups`` (which creates the topics first). Configuration: ``ROLLWIRE_*`` (Kafka) and
``ROLLWIRE_GROUPS_*`` (processors/groups/settings.py).

Partitioning: trajectories and evaluations are keyed by session, tasks and groups by task. Stage one
(``by_session``, stateless) reads the session-keyed topics and re-keys a small fact of each record
(never the token arrays) by task id onto the worker's own ``<app id>-by-task`` topic, which has the
``tasks`` topic's partition count and is partitioned the same way (murmur2 of the key, Kafka's default),
so a task's TaskAccepted and all its facts meet on one partition. Stage two (``by_task``, the single
writer of the ``tasks_state`` table) reads ``tasks`` and ``by-task``. A record without a task id (an
ad-hoc session) belongs to no group and is counted, not forwarded.

Deadlines: a timer sends a ``deadline`` record for a due task through ``by-task``, so the table is only
ever written by the agent (Faust writes changelogs from inside an event). The timer looks only at an
in-memory index of open tasks (``next_due``), rebuilt from the table after each rebalance. Delivery is at least once: the
agent waits for the broker's acknowledgement of a Group before it marks the task emitted, and a
re-emitted group has the same event id (assembly.group_event_id), which readers de-duplicate.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import faust
import orjson
from aiokafka.partitioner import murmur2
from faust.types import TP

from processors.groups.assembly import (
    FactError,
    State,
    TaskFacts,
    TaskState,
    build_group,
    decide,
    evaluation_fact,
    trajectory_fact,
)
from processors.groups.settings import GroupSettings
from processors.groups.topics import TABLES, by_task_topic
from processors.worker.changelogs import changelog_configs
from processors.worker.dead_letters import dead_letter
from processors.worker.faust_worker import RAW, app_settings, on_partitions, send_event, tables_recovered, worker_app
from processors.worker.health import serve_health
from schemas.codec import EventDecodeError, check_envelope, decode_event
from schemas.envelope import Event
from schemas.tasks import TaskAccepted
from schemas.topics import Topic
from schemas.transport.settings import KafkaSettings

logger = logging.getLogger(__name__)

kafka = KafkaSettings()
conf = GroupSettings()
registry = kafka.registry()
SOURCE = f"groups@{socket.gethostname()}:{os.getpid()}"
APP_ID = kafka.topic_prefix + conf.app_id
BY_TASK = by_task_topic(kafka, conf.app_id)
REQUEST_AGAIN_S = 5.0  # a deadline record the agent has not acted on yet is re-sent after this long

app = worker_app(
    APP_ID,
    **app_settings(kafka, store=conf.store, data_dir=conf.data_dir, partitions=kafka.task_partitions,
                   session_timeout_s=conf.session_timeout_s),
)

# Ours are external topics: Faust reads and writes them but never creates or reconfigures them.
session_inputs = app.topic(registry.name(Topic.TRAJECTORIES), registry.name(Topic.EVALUATIONS),
                           partitions=kafka.session_partitions, internal=False, **RAW)
task_inputs = app.topic(registry.name(Topic.TASKS), BY_TASK, partitions=kafka.task_partitions, internal=False, **RAW)
by_task = app.topic(BY_TASK, partitions=kafka.task_partitions, internal=False, **RAW)
groups = app.topic(registry.name(Topic.GROUPS), internal=False, **RAW)
dead_letters = app.topic(registry.name(Topic.DEAD_LETTER), internal=False, **RAW)

(TASKS_STATE,) = TABLES  # its changelog is created before the worker starts (processors.groups.topics)
tasks_state = app.Table(TASKS_STATE, partitions=kafka.task_partitions, key_type=bytes, value_type=bytes,
                        schema=faust.Schema(**RAW), help="task id -> TaskState (assembly.py)",
                        extra_topic_configs=changelog_configs(kafka))

counters: dict[str, int] = {"facts": 0, "no_task": 0, "late": 0, "emitted": 0, "incomplete": 0, "abandoned": 0,
                            "dead_lettered": 0}
# Worker memory only, rebuilt from the table after every rebalance: task id -> when the timer should next
# ask the agent to settle it (its deadline, then its abandonment), and when it last asked.
next_due: dict[str, float] = {}
requested: dict[str, float] = {}
index = {"stale": True}
started_at = time.time()
NOT_BEFORE = started_at + min(conf.grace_s, 10.0)  # after a (re)start, the log is replayed before deadlines fire


def task_partition(task_id: str) -> int:
    """The partition of ``tasks`` (and so of ``by-task``) a task id lands on: Kafka's default partitioner."""
    return (murmur2(task_id.encode("utf-8")) & 0x7FFFFFFF) % kafka.task_partitions


async def _forward(task_id: str, record: dict) -> None:
    await by_task.send(key=task_id.encode("utf-8"), value=orjson.dumps(record), partition=task_partition(task_id))


async def _send_event(topic: faust.TopicT, event: Event) -> None:
    """Send an event and wait for the broker's acknowledgement."""
    await (await send_event(topic, event, SOURCE))


async def _dead_letter(message: faust.types.Message, error_type: str, reason: str) -> None:
    logger.warning("dead-lettering %s@%d/%d: %s: %s", message.topic, message.partition, message.offset,
                   error_type, reason)
    await _send_event(dead_letters, dead_letter(
        topic=message.topic, partition=message.partition, offset=message.offset, key=message.key,
        value=message.value, headers=message.headers, group=APP_ID, error_type=error_type, reason=reason,
        max_message_bytes=kafka.max_message_bytes))
    counters["dead_lettered"] += 1


@app.agent(session_inputs, concurrency=1)
async def by_session(stream: faust.StreamT) -> None:
    """Trajectories and evaluations → a small fact each, re-keyed by task id onto ``by-task``."""
    async for event in stream.events():
        message = event.message
        try:
            document, _ = check_envelope(message.value, registry.by_name(message.topic))
            fact = trajectory_fact(document) if document["event_type"] == "trajectory" else evaluation_fact(document)
        except EventDecodeError as exc:
            await _dead_letter(message, exc.error_type, exc.reason)
            continue
        except FactError as exc:
            await _dead_letter(message, "invalid_event", str(exc))
            continue
        if not fact["task_id"]:
            counters["no_task"] += 1
            continue
        counters["facts"] += 1
        await _forward(fact["task_id"], fact)


async def _settle(task_id: str, state: TaskState) -> TaskState:
    """Emit or abandon the task if it is due; returns the state to store."""
    verdict = decide(state, now=time.time(), default_evaluator=conf.evaluator, min_fraction=conf.min_fraction,
                     abandon_s=conf.abandon_s, not_before=NOT_BEFORE)
    if verdict is State.EMITTED:
        group = build_group(state, default_evaluator=conf.evaluator, estimator=conf.estimator, eps=conf.eps,
                            min_usable=conf.min_usable)
        await _send_event(groups, group)  # acknowledged by the broker before the state says so
        counters["emitted"] += 1
        counters["incomplete"] += not group.complete
        logger.info("group of task %s: %d samples, complete=%s, no_signal=%s, usable=%s, insufficient=%s",
                    task_id, len(group.samples), group.complete, group.no_signal, group.usable, group.insufficient)
        state.state, state.group_event_id = State.EMITTED, group.event_id
        return state.closed()
    if verdict is State.ABANDONED:
        counters["abandoned"] += 1
        assert state.task is not None
        logger.warning("task %s abandoned: %d of %d samples in at its deadline + %.0f s", task_id,
                       state.count_in(state.evaluator(conf.evaluator)), len(state.task.session_ids), conf.abandon_s)
        state.state = State.ABANDONED
        return state.closed()
    return state


@app.agent(task_inputs, concurrency=1)
async def tasks(stream: faust.StreamT) -> None:
    """Tasks, facts and deadline requests, per task, one at a time (the single writer of the table)."""
    async for event in stream.events():
        message = event.message
        try:
            if message.topic == BY_TASK:
                record = orjson.loads(message.value)
                task_id = message.key.decode("utf-8")
                if not isinstance(record, dict) or record.get("kind") not in ("trajectory", "evaluation", "deadline"):
                    raise EventDecodeError("invalid_event", f"by-task record is not a fact: {str(record)[:200]}")
            else:
                decoded = decode_event(message.value, registry.by_name(message.topic))
                assert isinstance(decoded, TaskAccepted)  # the only event type of the tasks topic
                accepted: TaskAccepted = decoded
                task_id, record = accepted.task_id, None
        except EventDecodeError as exc:
            await _dead_letter(message, exc.error_type, exc.reason)
            continue
        except (orjson.JSONDecodeError, AttributeError, UnicodeDecodeError) as exc:
            await _dead_letter(message, "invalid_json", f"by-task record: {exc}")
            continue
        raw = tasks_state.get(task_id.encode())
        state = TaskState.loads(raw) if raw is not None else TaskState()
        if record is None:
            if state.state is State.OPEN and state.task is None:
                state.task = TaskFacts.of(accepted, conf.grace_s)
        elif record.get("kind") == "deadline":
            requested.pop(task_id, None)
        else:
            try:
                taken = state.add(record)
            except (FactError, KeyError) as exc:
                await _dead_letter(message, "invalid_event", f"by-task fact: {exc!r}")
                continue
            if not taken:
                counters["late"] += 1
                continue
        settled = await _settle(task_id, state)
        tasks_state[task_id.encode()] = settled.dumps()
        _index(task_id, settled, time.time())


def _index(task_id: str, state: TaskState, now: float) -> None:
    """Keep ``next_due`` in step with a task's stored state."""
    if state.state is not State.OPEN or state.task is None:
        next_due.pop(task_id, None)
        requested.pop(task_id, None)
        return
    deadline = state.task.deadline_at
    next_due[task_id] = max(deadline if now < deadline else deadline + conf.abandon_s, NOT_BEFORE)


@on_partitions(app.on_partitions_assigned)
async def _assigned(assigned: set[TP]) -> None:
    index["stale"] = True


@app.timer(conf.tick_s)
async def deadlines() -> None:
    """Ask the agent to settle open tasks that are due (a record through ``by-task``: only it writes)."""
    if app.rebalancing or not tables_recovered(app):
        index["stale"] = True
        return
    now = time.time()
    if index["stale"]:  # one scan of the (recovered) table after a rebalance; no await in between
        next_due.clear()
        for key, raw in list(tasks_state.items()):
            _index(key.decode(), TaskState.loads(raw), now)
        index["stale"] = False
    for task_id, due in list(next_due.items()):
        if now < due or now - requested.get(task_id, 0.0) < REQUEST_AGAIN_S:
            continue
        requested[task_id] = now
        await _forward(task_id, {"kind": "deadline", "task_id": task_id})


@app.task
async def health() -> None:
    """``GET /health`` on ROLLWIRE_GROUPS_HOST:PORT: 200 once the table is recovered, else 503."""
    await serve_health(app, conf.host, conf.port, lambda: dict(counters))
