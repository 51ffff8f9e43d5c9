"""Nothing a runtime started outlives the process that started it: a parent running a harness-like
command (a leader with a background child in its process group) through ``run_process_group`` is
SIGKILLed or stopped with SIGTERM, and both the leader and its child are gone shortly after; and the same
for a real gateway node (``rollwire gateway-node``) SIGKILLed while it runs a session's harness."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from schemas.sessions import SessionSpec, SessionStage
from schemas.tasks import AgentSpec, RuntimeSpec
from schemas.transport import KafkaSettings

# A harness-like command: a shell that starts a background child (like a tool command or a server),
# records both pids, and waits; both live in the command's own process group.
SCRIPT = "sleep 300 & echo $! > child.pid; echo $$ > leader.pid; wait"

PARENT = textwrap.dedent("""
    import asyncio, os, sys
    from pathlib import Path
    from producers.runtimes.process import run_process_group

    work = Path(sys.argv[1])
    asyncio.run(run_process_group(["sh", "-c", sys.argv[2]], cwd=work, env={"PATH": os.environ["PATH"]},
                                  timeout_s=600))
""")


def _alive(pid: int) -> bool:
    """Running (a zombie no one has reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_harness_processes_die_with_their_parent(tmp_path: Path, signum: int) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("process-death signals are Linux's")
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), SCRIPT], cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        _wait_for(lambda: (tmp_path / "leader.pid").exists() and (tmp_path / "child.pid").exists(), 30,
                  "the command to start")
        time.sleep(0.2)  # the pid files are written; let the shell reach `wait`
        leader = int((tmp_path / "leader.pid").read_text())
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(leader) and _alive(child)
        assert os.getpgid(child) == leader  # the child is in the command's group, not the parent's
        parent.send_signal(signum)
        parent.wait(10)
        _wait_for(lambda: not _alive(leader), 10, f"leader {leader} to die with its parent")
        _wait_for(lambda: not _alive(child), 10, f"background child {child} to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
        _kill_leftovers(tmp_path)


def _kill_leftovers(pid_dir: Path) -> None:
    for name in ("leader.pid", "child.pid"):
        path = pid_dir / name
        if path.exists():
            try:
                os.kill(int(path.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


async def test_harness_dies_with_a_killed_gateway_node(kafka: KafkaSettings, tmp_path: Path) -> None:
    """A real gateway node runs a session whose harness leaves a background child; the node is SIGKILLed
    mid-run; the harness and its child are gone shortly after (before, both ran on as orphans)."""
    from tests.harnesses.common import serve_standin_proxy
    from tests.producers.gateway_nodes import Lifecycle, publish, start_node, stop

    root = tmp_path / "sessions"
    root.mkdir()
    pids = tmp_path / "pids"
    pids.mkdir()
    script = SCRIPT.replace("child.pid", f"{pids}/child.pid").replace("leader.pid", f"{pids}/leader.pid")
    spec = SessionSpec(session_id=f"orphan-{os.getpid()}-{time.time_ns() % 10**9}", task_id="orphans",
                       instruction="wait", timeout_s=600, api_key="key-orphans", runtime=RuntimeSpec(),
                       agent=AgentSpec(harness="command", command=f"sh -c '{script}'"))
    with serve_standin_proxy(kafka) as proxy:
        node = start_node(kafka, proxy, root, "doomed")
        try:
            async with Lifecycle(kafka) as lifecycle:
                await publish(kafka, spec)
                await lifecycle.wait(lambda: any(s.stage is SessionStage.RUNNING
                                                 for s in lifecycle.stages(spec.session_id)), 90, "harness running")
            _wait_for(lambda: (pids / "leader.pid").exists() and (pids / "child.pid").exists(), 30,
                      "the harness to start")
            time.sleep(0.2)
            leader, child = (int((pids / name).read_text()) for name in ("leader.pid", "child.pid"))
            assert _alive(leader) and _alive(child)
            node.kill()
            node.wait(30)
            _wait_for(lambda: not _alive(leader), 10, f"harness {leader} to die with its node")
            _wait_for(lambda: not _alive(child), 10, f"the harness's child {child} to die with its node")
        finally:
            stop(node)
            _kill_leftovers(pids)
