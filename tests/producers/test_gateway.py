"""Gateway nodes on the shared Kafka, with a proxy over the stand-in engine, the local runtime and the
``command`` adapter running a small Python harness that calls the session's chat completions URL.

Nodes run in this process where only the pipeline matters, and as real subprocesses
(``python -m producers.gateway.cli``) where signals and killing matter. Every test reads the sessions'
lifecycle from ``session-events``: each session ends exactly once, with its stages in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import murmur2

from producers.gateway.control import create_app as create_control_app
from producers.gateway.ledger import GroupMembers
from producers.gateway.settings import GatewaySettings
from schemas.dead_letter import DeadLetter
from schemas.sessions import (
    FailureKind,
    SessionEnded,
    SessionSpec,
    SessionStage,
    SessionStatus,
)
from schemas.tasks import AgentSpec, RuntimeSpec
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.harnesses.common import serve_standin_proxy
from tests.producers.gateway_nodes import (
    STAGES, Lifecycle, node_settings, publish, running_node, start_node, stop)
from tests.proxy.conftest import ProxyUnderTest

# The harness: CALLS chat completions on the session (answers appended to answer.txt in the workspace),
# PAUSE seconds after each, then exit CODE; on a normal end it appends the session id to LOG (outside the
# workspace), so a test can count runs that went to completion.
HARNESS = r'''
import json, os, sys, time, urllib.request
calls, pause, code, log = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for i in range(calls):
    body = {"model": os.environ["ROLLWIRE_MODEL"], "max_tokens": 8,
            "messages": [{"role": "user", "content": f"step {i}: " + os.environ["ROLLWIRE_INSTRUCTION"]}]}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = json.load(response)["choices"][0]["message"]["content"]
    with open("answer.txt", "a") as out:
        out.write(f"{i}: {text!r}\n")
    time.sleep(pause)
with open(log, "a") as out:
    out.write(os.environ["ROLLWIRE_SESSION_ID"] + "\n")
sys.exit(code)
'''


@pytest.fixture
def harness(tmp_path: Path) -> Path:
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    return script


@pytest.fixture
def proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


def session_spec(harness: Path, *, calls: int = 2, pause: float = 0.0, code: int = 0, timeout_s: float = 60,
                 setup: list[str] | None = None, session_id: str | None = None, **fields: Any) -> SessionSpec:
    log = harness.parent / "completed.log"
    command = f"{sys.executable} {harness} {calls} {pause} {code} {log}"
    return SessionSpec(session_id=session_id or f"s-{uuid.uuid4().hex[:12]}", task_id="task-1",
                       instruction="write the answer", timeout_s=timeout_s, api_key=f"key-{uuid.uuid4().hex}",
                       runtime=RuntimeSpec(setup=setup or []),
                       agent=AgentSpec(harness="command", command=command), **fields)


def completed_runs(harness: Path) -> list[str]:
    log = harness.parent / "completed.log"
    return log.read_text().split() if log.exists() else []


def assert_ran_through_every_stage(lifecycle: Lifecycle, session_id: str, node: str) -> None:
    stages = lifecycle.stages(session_id)
    assert [s.stage.value for s in stages] == STAGES
    assert {s.node for s in stages} == {node}
    assert stages[0].elapsed_s is None and all(s.elapsed_s is not None and s.elapsed_s >= 0 for s in stages[1:])
    # The stage events come before the end, and the end's timings cover every stage.
    assert isinstance(lifecycle.events[session_id][-1], SessionEnded)
    timings = lifecycle.ends(session_id)[0].timings
    assert set(STAGES) <= set(timings) and timings["total"] >= sum(timings[s] for s in STAGES) - 0.01


async def committed_to_end(kafka: KafkaSettings, group: str) -> bool:
    """Whether the group's committed offsets on `sessions` reach the end of every partition."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    async with EventConsumer(kafka, [Topic.SESSIONS], group_id=None, dead_letters=False) as consumer:
        ends = await consumer._consumer.end_offsets(list(committed) or [])  # noqa: SLF001 - test introspection
    topic = kafka.registry().name(Topic.SESSIONS)
    return bool(committed) and all(
        committed[tp].offset == ends[tp] for tp in committed if tp.topic == topic and ends[tp] > 0)


# -- in-process nodes -------------------------------------------------------------------------------------

async def test_sessions_run_end_to_end_and_each_ends_once(kafka: KafkaSettings, proxy: ProxyUnderTest,
                                                          harness: Path, tmp_path: Path) -> None:
    """Three sessions on one node with two run slots: every stage in order, one end each, completed with
    the patch of what the harness wrote; ad-hoc and agent-less specs are not run; garbage is dead-lettered;
    the group's offsets are committed past everything."""
    specs = [session_spec(harness) for _ in range(3)]
    adhoc = session_spec(harness, origin="adhoc")
    agentless = SessionSpec(session_id=f"s-{uuid.uuid4().hex[:8]}", api_key="k" * 16)
    settings = node_settings(proxy)
    async with Lifecycle(kafka) as lifecycle, running_node(settings, kafka, tmp_path / "sessions"):
        await publish(kafka, *specs, adhoc, agentless)
        producer = AIOKafkaProducer(bootstrap_servers=kafka.kafka_bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(kafka.registry().name(Topic.SESSIONS), b"not json", key=b"garbage")
        finally:
            await producer.stop()
        ends = await lifecycle.ended(*(s.session_id for s in specs))
        for spec in specs:
            end = ends[spec.session_id]
            assert end.status is SessionStatus.COMPLETED and end.failure is None, end
            assert end.exit_code == 0
            assert end.patch is not None and "+++ b/answer.txt" in end.patch and "1: " in end.patch
            assert_ran_through_every_stage(lifecycle, spec.session_id, settings.node_name)
            calls = proxy.session_state(spec.session_id, spec.api_key)
            assert calls == {"session_id": spec.session_id, "live": False, "calls": 2, "origin": "rollout"}
        async with EventConsumer(kafka, [Topic.DEAD_LETTER], group_id=None, dead_letters=False) as consumer:
            letters: list[DeadLetter] = []
            for _ in range(50):
                letters += [r.event for r in await consumer.getmany(timeout_ms=200)]  # type: ignore[misc]
                if letters:
                    break
        assert [(d.error_type, d.consumer_group) for d in letters] == [("invalid_json", settings.group(kafka.topic_prefix))]
        for _ in range(50):
            if await committed_to_end(kafka, settings.group(kafka.topic_prefix)):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the group's offsets were not committed to the end of `sessions`")
    assert not lifecycle.events[adhoc.session_id] and not lifecycle.events[agentless.session_id]
    assert sorted(completed_runs(harness)) == sorted(s.session_id for s in specs)


async def test_budget_starts_at_init_not_at_dispatch(kafka: KafkaSettings, proxy: ProxyUnderTest, harness: Path,
                                                     tmp_path: Path) -> None:
    """With one run slot and no pre-warm, a session queued behind a 4 s run still completes on a 3 s budget:
    the wait in the queue is not charged."""
    first = session_spec(harness, calls=1, pause=4.0, timeout_s=60)
    second = session_spec(harness, calls=1, timeout_s=3.0)
    settings = node_settings(proxy, run_slots=1, prewarm=0)
    async with Lifecycle(kafka) as lifecycle, running_node(settings, kafka, tmp_path / "sessions"):
        await publish(kafka, first)
        await lifecycle.wait(lambda: any(s.stage is SessionStage.RUNNING for s in lifecycle.stages(first.session_id)))
        await publish(kafka, second)
        ends = await lifecycle.ended(first.session_id, second.session_id)
    assert ends[first.session_id].status is SessionStatus.COMPLETED
    assert ends[second.session_id].status is SessionStatus.COMPLETED, ends[second.session_id]
    assert ends[second.session_id].timings["queued"] > 3.0  # it waited longer than its budget, before init


async def test_timed_out_session_ends_with_its_patch_so_far(kafka: KafkaSettings, proxy: ProxyUnderTest,
                                                            harness: Path, tmp_path: Path) -> None:
    """A 1.5 s set-up counts against a 4 s budget; the harness answers once, then hangs: it is killed at the
    budget and the session ends as a timeout (the policy's) with the answer in its patch."""
    spec = session_spec(harness, calls=1, pause=120, timeout_s=4.0, setup=["sleep 1.5"])
    async with Lifecycle(kafka) as lifecycle, running_node(node_settings(proxy), kafka, tmp_path / "sessions"):
        await publish(kafka, spec)
        end = (await lifecycle.ended(spec.session_id))[spec.session_id]
    assert end.status is SessionStatus.TIMEOUT and end.failure is FailureKind.POLICY, end
    assert end.patch is not None and "+0: " in end.patch
    assert end.timings["init"] >= 1.5
    charged = end.timings["init"] + end.timings["ready"] + end.timings["running"]
    assert 4.0 <= charged < 4.0 + 5.0  # killed at the budget counted from init (plus the kill's grace)
    assert [s.stage.value for s in lifecycle.stages(spec.session_id)] == STAGES
    assert completed_runs(harness) == []


async def test_cancel_running_and_queued_sessions(kafka: KafkaSettings, proxy: ProxyUnderTest, harness: Path,
                                                  tmp_path: Path) -> None:
    """``POST /v1/sessions/{id}/cancel`` on the node: the running session is stopped and ends cancelled with its
    patch; a queued one ends cancelled without a runtime; an unknown id is a 404."""
    running = session_spec(harness, calls=1, pause=120)
    queued = session_spec(harness, calls=1)
    settings = node_settings(proxy, run_slots=1, prewarm=0)
    async with Lifecycle(kafka) as lifecycle, running_node(settings, kafka, tmp_path / "sessions") as node:
        await publish(kafka, running)
        await lifecycle.wait(lambda: "answer" in str(list((tmp_path / "sessions").glob("*/workspace/answer.txt"))))
        await publish(kafka, queued)
        await lifecycle.wait(lambda: lifecycle.stages(queued.session_id))
        transport = httpx.ASGITransport(app=create_control_app(node))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            held = (await client.get("/v1/sessions")).json()
            assert {h["session_id"]: h["stage"] for h in held} == {running.session_id: "running",
                                                                   queued.session_id: "queued"}
            answer = await client.post(f"/v1/sessions/{queued.session_id}/cancel", json={"reason": "not needed"})
            assert answer.status_code == 200 and answer.json()["cancelled"] is True
            answer = await client.post(f"/v1/sessions/{running.session_id}/cancel")
            assert answer.status_code == 200 and answer.json()["stage"] == "running"
            missing = await client.post("/v1/sessions/nope/cancel")
            assert missing.status_code == 404 and settings.node_name in missing.json()["detail"]
        ends = await lifecycle.ended(running.session_id, queued.session_id)
    assert ends[running.session_id].status is SessionStatus.CANCELLED and ends[running.session_id].failure is None
    assert "+0: " in (ends[running.session_id].patch or "")
    assert [s.stage.value for s in lifecycle.stages(running.session_id)] == STAGES
    assert ends[queued.session_id].status is SessionStatus.CANCELLED
    assert ends[queued.session_id].reason == "not needed" and ends[queued.session_id].patch is None
    assert [s.stage.value for s in lifecycle.stages(queued.session_id)] == ["queued"]
    assert completed_runs(harness) == []


# -- nodes as processes -----------------------------------------------------------------------------------

async def wait_for_members(kafka: KafkaSettings, names: set[str], timeout_s: float = 60) -> None:
    members = GroupMembers(kafka, GatewaySettings(node_name="x").group(kafka.topic_prefix))
    try:
        async def loop() -> None:
            while True:
                with contextlib.suppress(Exception):
                    if await members.live_nodes() == names:
                        return
                await asyncio.sleep(0.3)
        await asyncio.wait_for(loop(), timeout_s)
    finally:
        await members.close()


def ids_on_every_partition(kafka: KafkaSettings, per_partition: int) -> list[str]:
    """Session ids spread evenly over the `sessions` partitions (Kafka's default murmur2 partitioner)."""
    buckets: dict[int, list[str]] = defaultdict(list)
    while min((len(buckets[p]) for p in range(kafka.session_partitions)), default=0) < per_partition:
        session_id = f"s-{uuid.uuid4().hex[:12]}"
        partition = (murmur2(session_id.encode()) & 0x7FFFFFFF) % kafka.session_partitions
        if len(buckets[partition]) < per_partition:
            buckets[partition].append(session_id)
    return [s for p in range(kafka.session_partitions) for s in buckets[p]]


async def test_sigterm_drains_the_running_session_and_takes_no_new_one(kafka: KafkaSettings, proxy: ProxyUnderTest,
                                                                       harness: Path, tmp_path: Path) -> None:
    """SIGTERM while a session runs: it runs to completion, a session published after the signal is not
    taken, the node leaves the group and exits 0; the next node runs the one left (its offset was not
    committed)."""
    root = tmp_path / "sessions"
    root.mkdir()
    first = session_spec(harness, calls=2, pause=1.5)
    later = session_spec(harness, calls=1)
    node = start_node(kafka, proxy, root, "drainer")
    successor: subprocess.Popen | None = None
    try:
        async with Lifecycle(kafka) as lifecycle:
            await publish(kafka, first)
            await lifecycle.wait(lambda: any(s.stage is SessionStage.RUNNING
                                             for s in lifecycle.stages(first.session_id)), 60, "first running")
            node.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            await publish(kafka, later)
            await asyncio.to_thread(node.wait, 60)
            assert node.returncode == 0, (root.parent / "drainer.log").read_text()[-3000:]
            end = (await lifecycle.ended(first.session_id))[first.session_id]
            assert end.status is SessionStatus.COMPLETED and "+1: " in (end.patch or "")
            assert_ran_through_every_stage(lifecycle, first.session_id, "drainer")
            assert not lifecycle.events[later.session_id]

            successor = start_node(kafka, proxy, root, "successor")
            end = (await lifecycle.ended(later.session_id, timeout_s=90))[later.session_id]
            assert end.status is SessionStatus.COMPLETED
            assert {s.node for s in lifecycle.stages(later.session_id)} == {"successor"}
            assert len(lifecycle.ends(first.session_id)) == 1  # the successor did not run the first again
    finally:
        stop(node)
        if successor is not None:
            stop(successor)
    assert sorted(completed_runs(harness)) == sorted([first.session_id, later.session_id])


async def test_two_nodes_one_killed_every_session_still_ends_once(kafka: KafkaSettings, proxy: ProxyUnderTest,
                                                                 harness: Path, tmp_path: Path) -> None:
    """Must show: two nodes share the sessions; one is SIGKILLed while it runs a session. The other
    takes its partitions over: every session ends exactly once, completed or as an infrastructure failure
    (those the dead node had started its harness for), and no harness run goes to completion twice."""
    root = tmp_path / "sessions"
    root.mkdir()
    ids = ids_on_every_partition(kafka, per_partition=2)
    specs = [session_spec(harness, calls=2, pause=1.0, session_id=session_id) for session_id in ids]
    victim = start_node(kafka, proxy, root, "victim", run_slots=1, prewarm=1)
    survivor = start_node(kafka, proxy, root, "survivor", run_slots=1, prewarm=1)
    try:
        await wait_for_members(kafka, {"victim", "survivor"})
        async with Lifecycle(kafka) as lifecycle:
            await publish(kafka, *specs)

            def victim_runs() -> bool:
                return any(s.stage is SessionStage.RUNNING and s.node == "victim"
                           for spec in specs for s in lifecycle.stages(spec.session_id))

            await lifecycle.wait(victim_runs, 60, "the victim running a session")
            victim.kill()
            victim.wait(timeout=30)
            ends = await lifecycle.ended(*ids, timeout_s=120)
            await asyncio.sleep(1.0)
            for session_id in ids:
                assert len(lifecycle.ends(session_id)) == 1, lifecycle.events[session_id]
        statuses = {(e.status, e.failure) for e in ends.values()}
        assert statuses <= {(SessionStatus.COMPLETED, None), (SessionStatus.ERROR, FailureKind.INFRASTRUCTURE)}
        orphaned = [e for e in ends.values() if e.status is SessionStatus.ERROR]
        assert orphaned and all("gateway node victim stopped" in (e.reason or "") for e in orphaned)
        assert any(e.status is SessionStatus.COMPLETED for e in ends.values())
        # Every completed session was run to completion once; so was no session more than once.
        runs = completed_runs(harness)
        assert len(runs) == len(set(runs))
        assert {s for s, e in ends.items() if e.status is SessionStatus.COMPLETED} <= set(runs)
        assert any(s.node == "survivor" for spec in specs for s in lifecycle.stages(spec.session_id))
    finally:
        stop(victim)
        stop(survivor)


def test_takeover_rule() -> None:
    """Who may run a session it was handed (producers.gateway.ledger.decide): the rule the kill test relies on."""
    from producers.gateway.ledger import Decision, SessionRecord, decide

    def record(stage: SessionStage, node: str = "a", ended: bool = False) -> SessionRecord:
        return SessionRecord(ended=ended, stage=stage, node=node)

    live = frozenset({"a", "b"})
    assert decide(None, node="b", live_nodes=None) is Decision.RUN
    assert decide(record(SessionStage.QUEUED), node="b", live_nodes=live) is Decision.RUN  # let go, never claimed
    assert decide(record(SessionStage.RUNNING, ended=True), node="b", live_nodes=None) is Decision.SKIP
    assert decide(record(SessionStage.INIT), node="b", live_nodes=None) is Decision.WAIT  # members not known yet
    assert decide(record(SessionStage.RUNNING), node="b", live_nodes=live) is Decision.WAIT
    assert decide(record(SessionStage.READY), node="b", live_nodes=frozenset({"b"})) is Decision.RUN
    assert decide(record(SessionStage.RUNNING), node="b", live_nodes=frozenset({"b"})) is Decision.END_ORPHANED
    assert decide(record(SessionStage.POST_RUN, node="b"), node="b", live_nodes=live) is Decision.END_ORPHANED
