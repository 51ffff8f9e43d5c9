"""The real Qwen Code CLI on the real vLLM CPU engine through a proxy tier (two ``rollwire proxy`` processes
behind the real HAProxy front), the process serving its session SIGKILLed between two of its calls.

The CLI's first tool call waits, and while it waits the process that served the first call is killed. The
tool first writes a marker (the CLI has the whole first reply: it runs its tool), the killer waits for it,
and the tool then waits for a marker the killer writes once the process is dead: the kill falls between
two calls however slow the machine is. The CLI's next call reaches the other process through the front,
which reads the session's branch back from the log and continues it exactly. The session must look as if
nothing had happened: one branch, every prompt extending its parent's prompt + sampled ids, numbers
0..n-1, one trace when built.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import stack
from processors.builders import SessionFacts, build_trajectory
from schemas.admin_token import admin_token
from schemas.completions import Completion
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.harnesses.chat_runs import QWEN
from tests.harnesses.common import Script, ToolStep, clean_env, make_dirs, require_token_forcing
from tests.harnesses.isolation import run_harness
from tests.proxy.conftest import ProxyUnderTest
from tests.support.proxy_tier import proxy_tier, session_events

pytestmark = pytest.mark.kafka

WAIT_S = 300  # the longest the first tool call waits for the kill


@pytest.fixture
def tier(kafka: KafkaSettings, vllm_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[stack.ProxyTier]:
    require_token_forcing(vllm_url)
    with proxy_tier(kafka, vllm_url, tmp_path / "home", monkeypatch,
                    env={"ROLLWIRE_RECORD_REQUEST_BODY": "true", "ROLLWIRE_ENGINE_TIMEOUT_S": "300"}) as tier:
        yield tier


def _script(started: Path, killed: Path) -> Script:
    wait = f"for i in $(seq {WAIT_S * 4}); do [ -e {killed} ] && break; sleep 0.25; done"
    return Script(steps=(ToolStep("run_shell_command", {"command": f"echo alpha > notes.txt && touch {started} && {wait}",
                                                        "description": "Write alpha to notes.txt"}),
                         ToolStep("run_shell_command", {"command": "echo beta >> notes.txt",
                                                        "description": "Append beta to notes.txt"})),
                  answer="notes.txt now holds alpha and beta.", expected_files={"notes.txt": "alpha\nbeta\n"})


async def _first_event(kafka: KafkaSettings, session_id: str, timeout_s: float) -> Completion:
    async with EventConsumer(kafka, [Topic.COMPLETIONS], group_id=None, dead_letters=False) as consumer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for received in await consumer.getmany(timeout_ms=300):
                event = received.event
                if isinstance(event, Completion) and event.session_id == session_id:
                    return event
    raise AssertionError(f"no completion of {session_id} within {timeout_s:g} s")


def _kill_first_server(kafka: KafkaSettings, session_id: str, outcome: dict[str, str], started: Path,
                       killed: Path) -> None:
    """Once the session's first call is recorded and the CLI runs its first tool (``started``: the reply
    reached it whole, so the kill cannot cut it), SIGKILL the process that served the call, then write
    ``killed``, which the tool waits for."""
    try:
        first = asyncio.run(_first_event(kafka, session_id, 600))
        deadline = time.monotonic() + WAIT_S
        while not started.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"the CLI did not start its first tool within {WAIT_S} s")
            time.sleep(0.1)
        _, members = stack.tier_services()
        victim = next(m for m in members if m.name == first.proxy)
        pid = victim.pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        outcome["killed"] = str(first.proxy)
    except BaseException as exc:  # reported by the test
        outcome["error"] = repr(exc)
    finally:  # the tool stops waiting either way
        killed.touch()


async def test_a_killed_proxy_process_costs_the_cli_session_nothing(kafka: KafkaSettings, vllm_url: str,
                                                                     tier: stack.ProxyTier, tmp_path: Path) -> None:
    front = ProxyUnderTest(tier.entry.address, kafka, admin_token=admin_token())  # the tier shares one
    home, workspace = make_dirs(tmp_path / "run")
    started, killed = tmp_path / "started", tmp_path / "killed"
    script = _script(started, killed)
    session = front.new_session(session_id=f"tier-cli-{uuid.uuid4().hex[:8]}",
                                engine={"max_tokens": 256, "seed": 7, "turns": script.turns()})
    command, env = QWEN.configure(home, session)
    outcome: dict[str, str] = {}
    killer = threading.Thread(target=_kill_first_server, args=(kafka, session["session_id"], outcome, started, killed),
                              daemon=True)
    killer.start()
    run = run_harness(command, cwd=workspace, env={**clean_env(), "HOME": str(home), **env}, proxy_url=front.url,
                      timeout_s=600)
    killer.join(timeout=30)
    assert "error" not in outcome, outcome
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (workspace / "notes.txt").read_text() == "alpha\nbeta\n", run.stdout[-3000:]
    events = await session_events(kafka, session["session_id"])
    for event in events:  # shown when an assertion below fails
        print(event.sequence, event.proxy, event.engine, event.status, event.finish_reason, event.retry_of,
              event.continuation.mode, event.continuation.parent_sequence, len(event.request.messages),
              event.request.messages[-1].role, str(event.request.messages[-1].content)[:200])
    assert [e.sequence for e in events] == list(range(script.calls)), [
        (e.sequence, e.proxy, len(e.request.messages), e.request.messages[-1].role,
         str(e.request.messages[-1].content)[:80], e.continuation, e.finish_reason, e.retry_of) for e in events]
    assert all(e.status == "ok" for e in events)
    killed = outcome["killed"]
    assert events[0].proxy == killed and all(e.proxy != killed for e in events[1:])
    assert {e.continuation.branch for e in events} == {"b0"}
    for parent, child in zip(events, events[1:]):
        assert child.continuation.mode == "exact", child.continuation
        assert child.continuation.parent_sequence == parent.sequence
        whole = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()
        assert child.prompt_token_ids.tolist()[:len(whole)] == whole
    restore = events[1].continuation.restore
    assert restore is not None and restore.replayed == 1
    trajectory = build_trajectory("prefix_merging", events, SessionFacts(session_id=session["session_id"]))
    assert len(trajectory.traces) == 1, [t.sequences for t in trajectory.traces]
    assert trajectory.traces[0].sequences == list(range(script.calls))
    assert not trajectory.stats.problems, trajectory.stats.problems
