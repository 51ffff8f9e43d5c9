"""Fault injection where the fault is another real process: a Docker container's memory and pids limits,
a proxy process stopped while a session runs, an evaluator process whose evaluator raises.

Like tests/producers/test_fault_injection.py (the table, group and feed measure in fault_table.py), each
fault is a task of two samples whose first sessions meet it, run through a gateway node in this process
(with the ``docker`` runtime on a real engine where the fault is the container's), a rollout server and
Kafka, with no part mocked: the test reads the status the rollout server derived from the log, the
``session.ended`` events' evidence, and computes the group and feed outcome with the groups worker's own
assembly code. The measured rows are printed (``-s``) and appended to ``$ROLLWIRE_FAULT_TABLE`` when set.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from processors.groups.assembly import TaskFacts, TaskState, build_group, evaluation_fact, trajectory_fact
from producers.gateway.node import GatewayNode
from producers.gateway.settings import GatewaySettings
from producers.runtimes.base import Runtime
from producers.runtimes.docker import DockerRuntime, docker_client
from producers.runtimes.local import LocalRuntime
from producers.runtimes.reaper import NODE_LABEL
from schemas.rollouts import TaskStatus
from schemas.sessions import SessionEnded
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.harnesses.common import serve_standin_proxy
from tests.producers.rollout_helpers import rollout_server
from tests.producers.fault_table import HARNESS_CALL, fault_row, free_port, print_fault_table
from tests.proxy.conftest import ProxyUnderTest
from tests.servers import serve
from tests.support.processes import answers, kafka_env, rollwire_process
from tests.support.standin_engine import StandinConfig
from tests.support.standin_engine import create_app as create_standin

pytestmark = pytest.mark.kafka

IMAGE = "rollwire/base:bookworm"
MEMORY = "96m"
PIDS_LIMIT = 32

# The harness: the fault of MODE happens in each sample's first session only (a resubmission's id ends in
# -retry<n>), after one model call, so the agent had worked with the model when the machine failed it.
HARNESS = r'''
import json, os, sys, time, urllib.request
mode, flags = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
session = os.environ["ROLLWIRE_SESSION_ID"]
first = "-retry" not in session

''' + HARNESS_CALL + r'''
call()
if first and mode == "oom":  # past the container's memory limit: the kernel kills it (SIGKILL, exit 137)
    hog = bytearray(512 << 20)
    hog[::4096] = b"1" * len(hog[::4096])
if first and mode == "pids":  # forks until the container's pids limit refuses one (EAGAIN, uncaught)
    for _ in range(400):
        if os.fork() == 0:
            time.sleep(1)
            os._exit(0)
if first and mode == "proxy-down":  # the test stops the proxy, then the next call finds nobody there
    open(os.path.join(flags, "called-" + session), "w").close()
    deadline = time.time() + 90
    while not os.path.exists(os.path.join(flags, "proxy-gone")) and time.time() < deadline:
        time.sleep(0.05)
    call()
if mode == "graded":  # a change to grade; the grader script only in sample 0's
    with open("answer.txt", "w") as out:
        out.write("42\n")
    if session.endswith("-s0"):
        with open("grade.sh", "w") as out:
            out.write("#!/bin/sh\nexit 0\n")
        os.chmod("grade.sh", 0o755)
'''


@contextlib.contextmanager
def _proxy_process(kafka: KafkaSettings, engine_url: str, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``rollwire proxy`` over ``engine_url`` on ``port``, answering its /health."""
    with rollwire_process(["proxy", "--port", str(port), "--engine-url", engine_url], kafka_env(kafka), log,
                          lambda: answers(f"http://127.0.0.1:{port}/health")) as process:
        yield process


@contextlib.asynccontextmanager
async def _node(kafka: KafkaSettings, proxy_url: str, root: Path, runtime: Runtime) -> AsyncIterator[GatewayNode]:
    settings = GatewaySettings(proxy_url=proxy_url, port=0, run_slots=4, prewarm=2, init_workers=4, recheck_s=0.5,
                               node_name=f"node-{uuid.uuid4().hex[:6]}")
    node = GatewayNode(settings, kafka, runtime_for=lambda kind: runtime)
    task = asyncio.create_task(node.run())
    await asyncio.wait_for(node.started.wait(), 30)
    try:
        yield node
    finally:
        node.stop_now()
        await asyncio.wait_for(task, 60)


async def _run(kafka: KafkaSettings, proxy_url: str, tmp_path: Path, tasks: dict[str, dict[str, Any]],
               runtime: Runtime, *, during: Callable[[Callable[[], Awaitable[dict[str, TaskStatus]]]], Awaitable[None]]
               | None = None, timeout_s: float = 180, **server: Any) -> dict[str, TaskStatus]:
    """Submit ``tasks`` (by fault) to a rollout server with a node running them; their status once done.
    ``during``, given a way to read the statuses, runs alongside (the test's hand in the fault)."""
    with rollout_server(kafka, tmp_path / "server", **{"evaluation_wait_s": 0, **server}) as url:
        async with _node(kafka, proxy_url, tmp_path / "sessions", runtime), \
                httpx.AsyncClient(timeout=30) as client:
            for body in tasks.values():
                response = await client.post(f"{url}/v1/tasks", json=body)
                assert response.status_code == 202, response.text

            async def read() -> dict[str, TaskStatus]:
                return {fault: TaskStatus.model_validate((await client.get(f"{url}/v1/tasks/{body['task_id']}")).json())
                        for fault, body in tasks.items()}

            async def all_done() -> dict[str, TaskStatus]:
                if during is not None:
                    await during(read)
                while True:
                    statuses = await read()
                    if all(s.state.value == "done" for s in statuses.values()):
                        return statuses
                    await asyncio.sleep(0.3)

            return await asyncio.wait_for(all_done(), timeout_s)


async def _ends(kafka: KafkaSettings, session_ids: set[str], timeout_s: float = 30) -> dict[str, SessionEnded]:
    """The ``session.ended`` events of these sessions, read from the log."""
    found: dict[str, SessionEnded] = {}
    async with EventConsumer(kafka, [Topic.SESSION_EVENTS], group_id=None, dead_letters=False) as consumer:
        async def loop() -> None:
            while not session_ids <= found.keys():
                for received in await consumer.getmany(timeout_ms=300):
                    if isinstance(received.event, SessionEnded) and received.event.session_id in session_ids:
                        found[received.event.session_id] = received.event
        await asyncio.wait_for(loop(), timeout_s)
    return found


def _first_sessions(status: TaskStatus) -> set[str]:
    return {s.retries[0].session_id for s in status.sessions if s.retries}


def _expect(row: dict[str, Any], first: str, final: str, failure: str, retried: int, in_feed: bool) -> None:
    assert (row["first"], row["final"], row["failure"], row["retried"], row["in_feed"]) == (
        first, final, failure, retried, in_feed), row


def _script(where: Path) -> Path:
    script = where / "faulty_harness.py"
    script.write_text(HARNESS)
    return script


@pytest.fixture
def proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


@pytest.mark.docker
async def test_a_container_killed_by_its_memory_or_pids_limit_is_the_sandboxs(
        kafka: KafkaSettings, proxy: ProxyUnderTest, tmp_path: Path, docker_images: list[str]) -> None:
    """A harness in a container that allocates past ``runtime.memory`` is killed by the kernel (exit 137,
    and the engine's ``oom`` event: ``oom_killed`` in the evidence); one that forks past
    ``runtime.pids_limit`` dies of EAGAIN (the container's pids cgroup counted it: ``pids_limit_hit``).
    Both after a model call, both the sandbox's (``sandbox_killed``, infrastructure), resubmitted; the
    resubmissions complete, so both samples are back in their group and in the feed."""
    assert IMAGE in docker_images
    repo = tmp_path / "repo"
    repo.mkdir()
    _script(repo)
    run = uuid.uuid4().hex[:6]
    node_name = f"faults-{run}"
    runtime = DockerRuntime(tmp_path / "sessions", kill_grace_s=0.5, mount_harness_cache=False, node=node_name)

    def task(task_id: str, mode: str) -> dict[str, Any]:
        return {"task_id": task_id, "instruction": "answer", "num_samples": 2, "timeout_s": 120, "max_retries": 1,
                "agent": {"harness": "command", "command": f"python3 faulty_harness.py {mode}"},
                "runtime": {"kind": "docker", "image": IMAGE, "repo": str(repo), "memory": MEMORY,
                            "pids_limit": PIDS_LIMIT}}

    tasks = {f"container OOM ({MEMORY} memory limit)": task(f"oom-{run}", "oom"),
             f"container pids limit ({PIDS_LIMIT})": task(f"pids-{run}", "pids")}
    try:
        statuses = await _run(kafka, proxy.url, tmp_path, tasks, runtime)
    finally:
        client = docker_client()
        left = client.containers.list(all=True, ignore_removed=True, filters={"label": f"{NODE_LABEL}={node_name}"})
        for container in left:
            container.remove(force=True)
    assert left == [], "a session left its container behind"
    rows = [fault_row(fault, status) for fault, status in statuses.items()]
    print_fault_table(rows)
    for row in rows:
        _expect(row, "sandbox_killed", "completed", "-", 1, True)
        assert row["usable"] == 2 and not row["insufficient"]
    oom, pids = statuses.values()
    ends = await _ends(kafka, _first_sessions(oom) | _first_sessions(pids))
    for session_id in _first_sessions(oom):
        evidence = ends[session_id].evidence
        assert evidence is not None, session_id
        assert (evidence.exit_code, evidence.signal, evidence.oom_killed) == (137, 9, True), evidence
        assert evidence.model_calls == 1
    for session_id in _first_sessions(pids):
        evidence = ends[session_id].evidence
        assert evidence is not None and evidence.exit_code == 1 and evidence.pids_limit_hit is True, evidence
        assert any("Resource temporarily unavailable" in line for line in evidence.stderr_head), evidence
        assert evidence.model_calls == 1 and not evidence.oom_killed


async def test_the_proxy_stopped_mid_session_is_the_infrastructures(kafka: KafkaSettings, tmp_path: Path) -> None:
    """A real proxy process answers each session's first model call and is then killed; the harness's next
    call finds nobody (it exits 1 with its traceback, after a model call: the policy's, were it not for
    the proxy): the node finds the proxy unreachable after the run (``proxy_unreachable``,
    infrastructure), and the sample is resubmitted. The proxy, started again on its port, reads the
    sessions topic from the beginning and serves the resubmissions, which complete."""
    script = _script(tmp_path)
    flags = tmp_path / "flags"
    flags.mkdir()
    port = free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    task = {"task_id": f"proxy-{uuid.uuid4().hex[:6]}", "instruction": "answer", "num_samples": 2, "timeout_s": 120,
            "max_retries": 1,
            "agent": {"harness": "command", "command": f"{sys.executable} {script} proxy-down {flags}"}}
    tasks = {"proxy stopped mid-session": task}
    with serve(create_standin(StandinConfig(latency_ms=1, reply_tokens=16))) as engine_url, \
            contextlib.ExitStack() as stack:
        stack.enter_context(_proxy_process(kafka, engine_url, port, tmp_path / "proxy-1.log"))

        async def stop_and_restart(read: Callable[[], Awaitable[dict[str, TaskStatus]]]) -> None:
            while len(list(flags.glob("called-*"))) < 2:  # each first session made its call
                ended = [s for s in (await read())["proxy stopped mid-session"].sessions if s.status is not None]
                assert not ended, f"a session ended before the proxy was stopped: {ended}"
                await asyncio.sleep(0.1)
            await asyncio.to_thread(stack.close)  # SIGKILL: the proxy is gone mid-session
            (flags / "proxy-gone").touch()
            while not all(len(s.retries) == 1 for s in (await read())["proxy stopped mid-session"].sessions):
                await asyncio.sleep(0.2)
            # Started again only once both ends are written, so the node's check after the run saw it gone.
            await asyncio.to_thread(stack.enter_context,
                                    _proxy_process(kafka, engine_url, port, tmp_path / "proxy-2.log"))

        statuses = await _run(kafka, proxy_url, tmp_path, tasks, LocalRuntime(root=tmp_path / "sessions"),
                              during=stop_and_restart)
    row = fault_row("proxy stopped mid-session", statuses["proxy stopped mid-session"])
    print_fault_table([row])
    _expect(row, "proxy_unreachable", "completed", "-", 1, True)
    assert row["usable"] == 2 and not row["insufficient"]
    ends = await _ends(kafka, _first_sessions(statuses["proxy stopped mid-session"]))
    for ended in ends.values():
        evidence = ended.evidence
        assert ended.failure is not None and ended.failure.value == "infrastructure"
        assert evidence is not None and evidence.exit_code == 1 and evidence.model_calls is None, evidence
        assert evidence.detail is not None and "proxy unreachable" in evidence.detail, evidence
        assert evidence.stderr_head[:1] == ["Traceback (most recent call last):"], evidence
        assert "Connection refused" in evidence.detail, evidence  # the harness's own last words


async def test_an_evaluator_process_that_raises_is_kept_out_not_resubmitted(
        kafka: KafkaSettings, proxy: ProxyUnderTest, tmp_path: Path) -> None:
    """``rollwire evaluator run tests`` scores both completed sessions of a task; its grader is
    ``./grade.sh``, which only sample 0's patch adds, so on sample 1 the evaluator raises (no such file):
    the runner writes an evaluation with status ``error`` (``evaluator_crashed``). That sample has no
    reward: out of the baseline and the feed, and not resubmitted (the session is fine); sample 0 keeps its
    reward, so the group has 1 usable sample of 2 and is not marked insufficient."""
    script = _script(tmp_path)
    task = {"task_id": f"eval-{uuid.uuid4().hex[:6]}", "instruction": "answer", "num_samples": 2, "timeout_s": 60,
            "max_retries": 1, "agent": {"harness": "command", "command": f"{sys.executable} {script} graded"},
            "evaluator": {"name": "tests", "settings": {"command": ["./grade.sh"], "timeout_s": 30}}}
    log = tmp_path / "evaluator.log"
    with rollwire_process(["evaluator", "run", "tests"], {**kafka_env(kafka), "TMPDIR": str(tmp_path)}, log,
                  lambda: "consuming as group" in log.read_text()):
        statuses = await _run(kafka, proxy.url, tmp_path, {"evaluator crashing": task},
                              LocalRuntime(root=tmp_path / "sessions"), evaluation_wait_s=90)
    status = statuses["evaluator crashing"]
    assert [s.status.value if s.status else None for s in status.sessions] == ["completed", "completed"]
    assert [len(s.retries) for s in status.sessions] == [0, 0], "an evaluator crash is not resubmitted"
    verdicts = [s.evaluations[0] for s in status.sessions]
    assert (verdicts[0].status, verdicts[0].reward) == ("ok", 1.0), verdicts
    assert verdicts[1].status == "error" and verdicts[1].reward is None, verdicts
    assert verdicts[1].error is not None and "evaluator raised FileNotFoundError" in verdicts[1].error, verdicts
    assert "evaluator tests failed on session" in log.read_text()  # the runner logged the traceback

    state = TaskState(TaskFacts(status.task_id, [s.session_id for s in status.sessions], 2, 0.0, "tests", None,
                                None, 1))
    for sample, verdict in zip(status.sessions, verdicts):
        state.add(trajectory_fact({"event_id": f"t-{sample.session_id}", "session_id": sample.session_id,
                                   "task_id": status.task_id, "session_status": "completed"}))
        state.add(evaluation_fact({"event_id": f"e-{sample.session_id}", "session_id": sample.session_id,
                                   "task_id": status.task_id, "evaluator": "tests", "status": verdict.status,
                                   "reward": verdict.reward}))
    group = build_group(state, default_evaluator="tests", estimator="grpo", eps=1e-6, min_usable=0.5)
    scored, crashed = group.samples
    assert scored.advantage is not None and scored.in_baseline
    assert crashed.advantage is None and not crashed.in_baseline
    assert crashed.failure is not None and crashed.failure.value == "infrastructure"
    assert group.usable == 1 and not group.insufficient
    print_fault_table([{"fault": "evaluator process raising", "first": "evaluator_crashed", "final": "completed",
                   "failure": "infrastructure", "retried": 0, "usable": group.usable,
                   "insufficient": group.insufficient, "in_feed": False}])
