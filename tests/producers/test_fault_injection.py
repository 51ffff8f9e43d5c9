"""Fault injection through real processes: a gateway node (this process, the local runtime, real harness
processes), a rollout server, the proxy over the stand-in engine, and Kafka, with no part mocked.

Each fault is a task of two samples whose first session meets the fault. The test reads what the rollout
server derived from the log (status, cause, failure kind, the sessions a resubmission replaced) and
computes the group the groups worker would emit from those ends (processors.groups.assembly, the same
code) and whether the trainer feed would train on each sample (an advantage, in a group not marked
insufficient). The measured table is printed (run with ``-s``) and written to
``$ROLLWIRE_FAULT_TABLE`` when set.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from processors.groups.assembly import TaskFacts, TaskState, build_group, evaluation_fact, trajectory_fact
from producers.gateway.settings import GatewaySettings
from producers.harness_install import HARNESSES
from schemas.rollouts import TaskStatus
from schemas.transport import KafkaSettings
from tests.harnesses.common import serve_standin_proxy
from tests.producers.gateway_nodes import running_node
from tests.producers.fault_table import HARNESS_CALL, fault_row, free_port, print_fault_table
from tests.producers.rollout_helpers import rollout_server, wait_until
from tests.proxy.conftest import ProxyUnderTest

# The harness: MODE's fault happens in the sample's first session only (a flag file per sample), then it
# makes one chat call and exits 0 (or, for `policy`, exits 1 after its call in every session).
HARNESS = r'''
import json, os, signal, sys, urllib.request
mode, flags = sys.argv[1], sys.argv[2]
sample = os.environ["ROLLWIRE_SESSION_ID"].split("-retry")[0]
flag = os.path.join(flags, sample)
first = not os.path.exists(flag)
open(flag, "a").close()

''' + HARNESS_CALL + r'''
if first and mode == "crash":
    import no_such_module_of_the_harness  # dies before any model call, with a traceback of its runtime
if first and mode == "killed":
    call()
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does at the memory limit
if first and mode == "silent":
    sys.exit(3)  # no model call, nothing recognisable on stderr: nobody can tell whose failure it is
call()
sys.exit(1 if mode == "policy" else 0)
'''

# npm: fails for pi's package; for qwen-code's, writes a stand-in CLI (answers --version, makes one call).
FAKE_NPM = r'''#!{python}
import os, sys
with open({count!r}, "a") as out:
    out.write(" ".join(sys.argv[1:]) + "\n")
prefix = sys.argv[sys.argv.index("--prefix") + 1]
if any(a.startswith("@mariozechner/pi-coding-agent") for a in sys.argv):
    sys.stderr.write("npm error code ENOTEMPTY\nnpm error syscall rename\n")
    sys.exit(1)
os.makedirs(os.path.join(prefix, "node_modules", ".bin"))
cli = os.path.join(prefix, "node_modules", ".bin", "qwen")
with open(cli, "w") as out:
    out.write({cli!r})
os.chmod(cli, 0o755)
print("added 1 package in 0s")
'''

FAKE_QWEN = r'''#!{python}
import json, os, sys, urllib.request
if "--version" in sys.argv:
    print("{version}")
    sys.exit(0)
body = {{"model": os.environ["OPENAI_MODEL"], "max_tokens": 8, "messages": [{{"role": "user", "content": "hi"}}]}}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={{"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"}})
with urllib.request.urlopen(request, timeout=30) as response:
    json.load(response)
'''

HALF_INSTALLED = "#!/bin/sh\necho \"Error: Cannot find module '/cache/qwen-code/dist/cli.js'\" >&2\nexit 1\n"


@pytest.fixture
def proxy(kafka: KafkaSettings) -> Iterator[ProxyUnderTest]:
    with serve_standin_proxy(kafka) as proxy:
        yield proxy


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh harness cache with a half-installed qwen-code prefix in it, and the npm above on PATH;
    returns the file npm appends its command lines to."""
    count = tmp_path / "npm-runs.txt"
    cli = FAKE_QWEN.format(python=sys.executable, version=HARNESSES["qwen-code"].version)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text(FAKE_NPM.format(python=sys.executable, count=str(count), cli=cli))
    npm.chmod(0o755)
    cache = tmp_path / "cache"
    broken = cache / "harnesses" / f"qwen-code-{HARNESSES['qwen-code'].version}" / "node_modules" / ".bin"
    broken.mkdir(parents=True)
    (broken / "qwen").write_text(HALF_INSTALLED)
    (broken / "qwen").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ROLLWIRE_CACHE_DIR", str(cache))
    return count


def _command(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "faulty_harness.py"
    script.write_text(HARNESS)
    flags = tmp_path / "flags"
    flags.mkdir(exist_ok=True)
    return f"{sys.executable} {script} {mode} {flags}"


def _task(task_id: str, agent: dict[str, Any], *, setup: list[str] | None = None, retries: int = 1) -> dict[str, Any]:
    return {"task_id": task_id, "instruction": "answer", "num_samples": 2, "timeout_s": 60, "max_retries": retries,
            "agent": agent, "runtime": {"setup": setup or []}}


async def _run(kafka: KafkaSettings, proxy: ProxyUnderTest, tmp_path: Path, tasks: dict[str, dict[str, Any]],
               **node: Any) -> dict[str, TaskStatus]:
    settings = GatewaySettings(proxy_url=proxy.url, port=0, run_slots=4, prewarm=2, init_workers=4, recheck_s=0.5,
                               node_name=f"node-{uuid.uuid4().hex[:6]}", **node)
    with rollout_server(kafka, tmp_path / "server", evaluation_wait_s=0) as url:
        async with running_node(settings, kafka, tmp_path / "sessions"):
            async with httpx.AsyncClient(timeout=30) as client:
                for body in tasks.values():
                    response = await client.post(f"{url}/v1/tasks", json=body)
                    assert response.status_code == 202, response.text

                async def all_done() -> dict[str, TaskStatus]:
                    while True:
                        statuses = {}
                        for fault, body in tasks.items():
                            answer = await client.get(f"{url}/v1/tasks/{body['task_id']}")
                            statuses[fault] = TaskStatus.model_validate(answer.json())
                        if all(s.state.value == "done" for s in statuses.values()):
                            return statuses
                        await asyncio.sleep(0.3)

                return await asyncio.wait_for(all_done(), 150)


async def test_faults_are_attributed_resubmitted_and_kept_out_of_training(
        kafka: KafkaSettings, proxy: ProxyUnderTest, tmp_path: Path, fake_npm: Path) -> None:
    """Each fault of the machine is the infrastructure's, resubmitted, and never trained on as the
    policy's; a resubmission that works puts the sample back in its group; the agent failing after it
    worked with the model is the policy's; a failure nobody can attribute is unknown, not resubmitted and
    kept out."""
    run = uuid.uuid4().hex[:6]
    command = {mode: {"harness": "command", "command": _command(tmp_path, mode)}
               for mode in ("crash", "killed", "silent", "policy", "ok")}
    tasks = {
        "npm failing": _task(f"npm-{run}", {"harness": "pi"}),
        "half-installed CLI": _task(f"half-{run}", {"harness": "qwen-code"}),
        "harness binary missing": _task(f"missing-{run}", {"harness": "command",
                                                            "command": "/nonexistent/bin/agent {instruction}"}),
        "crash before any model call": _task(f"crash-{run}", command["crash"]),
        "killed by SIGKILL (OOM killer)": _task(f"killed-{run}", command["killed"]),
        "runtime init failure": _task(f"init-{run}", command["ok"], setup=["echo cannot check out >&2; exit 3"]),
        "exit without a call, nothing recognised": _task(f"silent-{run}", command["silent"]),
        "agent fails after its calls": _task(f"policy-{run}", command["policy"]),
    }
    statuses = await _run(kafka, proxy, tmp_path, tasks)
    rows = [fault_row(fault, status) for fault, status in statuses.items()]
    print_fault_table(rows)
    by = {r["fault"]: r for r in rows}
    expected = {  # first cause, final status, final failure, resubmissions, in the feed
        "npm failing": ("harness_install", "error", "infrastructure", 1, False),
        "half-installed CLI": ("-", "completed", "-", 0, True),
        "harness binary missing": ("harness_missing", "error", "infrastructure", 1, False),
        "crash before any model call": ("harness_crashed", "completed", "-", 1, True),
        "killed by SIGKILL (OOM killer)": ("sandbox_killed", "completed", "-", 1, True),
        "runtime init failure": ("runtime_init", "error", "infrastructure", 1, False),
        "exit without a call, nothing recognised": ("unknown", "error", "unknown", 0, False),
        "agent fails after its calls": ("agent_failed", "error", "policy", 0, True),
    }
    for fault, (first, final, failure, retried, in_feed) in expected.items():
        row = by[fault]
        assert (row["first"], row["final"], row["failure"], row["retried"], row["in_feed"]) == (
            first, final, failure, retried, in_feed), row
    # Both samples of a task meet the same fault: a task whose resubmissions failed too has no usable sample.
    assert by["runtime init failure"]["insufficient"] and by["npm failing"]["insufficient"]
    assert not by["crash before any model call"]["insufficient"]
    # The end event carries the evidence.
    crashed = statuses["crash before any model call"].sessions[0]
    assert crashed.retries[0].cause is not None and crashed.retries[0].cause.value == "harness_crashed"
    # npm ran once for the half-installed prefix (reinstalled, then used by both samples) and once per
    # pi session (each failing install is tried again by the next session).
    runs = fake_npm.read_text().splitlines()
    assert sum("@qwen-code/qwen-code" in line for line in runs) == 1
    assert sum("@mariozechner/pi-coding-agent" in line for line in runs) == 4


async def test_engine_down_when_a_session_starts_is_the_infrastructures(kafka: KafkaSettings, proxy: ProxyUnderTest,
                                                                      tmp_path: Path) -> None:
    """The engine's /health does not answer when the session would start: the harness is not run, the
    session is the infrastructure's (engine_unavailable) and is resubmitted."""
    tasks = {"engine down at session start": _task(f"engine-{uuid.uuid4().hex[:6]}",
                                                   {"harness": "command", "command": _command(tmp_path, "ok")})}
    statuses = await _run(kafka, proxy, tmp_path, tasks, engine_url=f"http://127.0.0.1:{free_port()}")
    row = fault_row("engine down at session start", statuses["engine down at session start"])
    print_fault_table([row])
    assert (row["first"], row["final"], row["failure"], row["retried"], row["in_feed"]) == (
        "engine_unavailable", "error", "infrastructure", 1, False)


def test_an_evaluator_crash_is_kept_out_and_not_resubmitted() -> None:
    """A completed session whose evaluator crashed: no advantage, out of the baseline, not usable; the
    rollout server does not resubmit it (the session is fine: running it again does not repair the
    evaluator)."""
    from producers.rollout.expand import expand
    from producers.rollout.status import RolloutView
    from schemas.evaluations import Evaluation
    from schemas.sessions import SessionEnded, SessionStatus
    from schemas.tasks import TaskRequest

    view = RolloutView(evaluation_wait_s=0)
    accepted, specs = expand(TaskRequest(task_id="ev", instruction="x", num_samples=2,
                                         agent={"harness": "command", "command": "true"},
                                         evaluator={"name": "tests"}), max_retries=2)
    for event in (*specs, accepted):
        view.apply(event)
    for spec in specs:
        view.apply(SessionEnded(session_id=spec.session_id, task_id="ev", status=SessionStatus.COMPLETED))
    view.apply(Evaluation(session_id=specs[0].session_id, task_id="ev", evaluator="tests", reward=1.0))
    view.apply(Evaluation(session_id=specs[1].session_id, task_id="ev", evaluator="tests", status="error",
                          error="Traceback: the grader crashed"))
    assert view.take_retries() == []
    state = TaskState(TaskFacts("ev", [s.session_id for s in specs], 2, 0.0, "tests", None, None, 2))
    for spec, (status, reward) in zip(specs, [("ok", 1.0), ("error", None)]):
        state.add(trajectory_fact({"event_id": f"t-{spec.session_id}", "session_id": spec.session_id,
                                   "task_id": "ev", "session_status": "completed"}))
        state.add(evaluation_fact({"event_id": f"e-{spec.session_id}", "session_id": spec.session_id,
                                   "task_id": "ev", "evaluator": "tests", "status": status, "reward": reward}))
    group = build_group(state, default_evaluator="tests", estimator="grpo", eps=1e-6, min_usable=0.5)
    crashed = group.samples[1]
    assert crashed.advantage is None and not crashed.in_baseline and crashed.failure is not None
    assert crashed.failure.value == "infrastructure" and group.usable == 1 and not group.insufficient
    print_fault_table([{"fault": "evaluator crashing", "first": "evaluator_crashed", "final": "completed",
                   "failure": "infrastructure", "retried": 0, "usable": 1, "insufficient": False,
                   "in_feed": False}])
