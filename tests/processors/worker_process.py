"""A real trajectory worker (``python -m deploy.cli processors``) as a subprocess, and session traffic.

Integration tests start the worker on the test's fresh topic prefix with its own app id, data dir and
health port, and stop it (SIGTERM, or SIGKILL for the crash test) at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from processors.builders import SessionFacts, build_trajectory
from schemas.completions import Completion
from schemas.envelope import Event
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus
from schemas.trajectories import Trajectory
from schemas.transport.consumer import EventConsumer
from schemas.topics import Topic
from schemas.transport.settings import KafkaSettings
from tests.processors.factory import make_call

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class WorkerProcess:
    """One Faust worker subprocess (``rollwire processors``, or ``groups`` with its own settings prefix);
    ``start()`` waits for its /health page."""

    kafka: KafkaSettings
    data_dir: Path
    app_id: str = field(default_factory=lambda: f"processors-{uuid.uuid4().hex[:6]}")
    port: int = field(default_factory=free_port)
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    command: str = "processors"
    settings_prefix: str = "ROLLWIRE_PROCESSORS_"

    def env(self) -> dict[str, str]:
        own = {"APP_ID": self.app_id, "DATA_DIR": str(self.data_dir), "PORT": str(self.port), "TICK_S": "0.2"}
        return {**os.environ, "ROLLWIRE_KAFKA_BOOTSTRAP": self.kafka.kafka_bootstrap,
                "ROLLWIRE_TOPIC_PREFIX": self.kafka.topic_prefix,
                "ROLLWIRE_SESSION_PARTITIONS": str(self.kafka.session_partitions),
                "ROLLWIRE_TASK_PARTITIONS": str(self.kafka.task_partitions),
                **{self.settings_prefix + name: value for name, value in own.items()}, **self.extra_env}

    def start(self, timeout_s: float = 90) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir.parent / f"{self.app_id}.log").open("ab")
        self.process = subprocess.Popen([sys.executable, "-m", "deploy.cli", self.command], cwd=ROOT,
                                        env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.health() is not None:
                return
            time.sleep(0.2)
        raise RuntimeError(f"worker not healthy within {timeout_s} s:\n{self.log_tail()}")

    def health(self) -> dict | None:
        try:
            response = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def log_tail(self, lines: int = 40) -> str:
        path = self.data_dir.parent / f"{self.app_id}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no flush, no commit, no goodbye."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class SessionPlan:
    """One session's events: spec, completions (prompts extending each other), end (or none)."""

    spec: SessionSpec
    completions: list[Completion]
    end: SessionEnded | None

    @property
    def session_id(self) -> str:
        return self.spec.session_id


def linear_session(session_id: str, *, turns: int, builder: str = "prefix_merging", ended: bool = True,
                   seed: int = 0, branch_at: int | None = None, versions: Sequence[str] | None = None,
                   straddle: bool = False) -> SessionPlan:
    """A multi-turn session; with ``branch_at``, that turn starts from a fresh prompt (a new branch).

    ``versions``: turn ``t``'s engine weight version (cycled), else every call carries the label
    ``step-3``; ``straddle``: the last call's sampled tokens span its version and the next one.
    """
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, 64).tolist()
    calls = []
    for turn in range(turns):
        if turn == branch_at:
            prompt = rng.integers(0, 150_000, 40).tolist()
        sampled = rng.integers(0, 150_000, int(rng.integers(4, 40))).tolist()
        version = versions[turn % len(versions)] if versions else "step-3"
        call = make_call(turn, prompt, sampled, session_id=session_id, policy_version=version,
                         finish_reason="tool_calls")
        if straddle and turn == turns - 1:
            half, after = len(sampled) // 2, str(int(version.lstrip("v")) + 1)
            call = call.model_copy(update={"weight_versions": [
                {"version": version, "start": 0, "end": half}, {"version": after, "start": half, "end": len(sampled)}]})
        calls.append(call)
        prompt = prompt + sampled + rng.integers(0, 150_000, int(rng.integers(5, 60))).tolist()
    spec = SessionSpec(session_id=session_id, task_id=f"task-{session_id}", builder=builder,
                       policy_version="step-3")
    end = SessionEnded(session_id=session_id, task_id=spec.task_id, status=SessionStatus.COMPLETED) if ended else None
    return SessionPlan(spec, calls, end)


async def read_events(kafka: KafkaSettings, topic: Topic, *, until: int, timeout_s: float) -> list[Event]:
    """Every event on ``topic`` (duplicates by event id dropped) once ``until`` are there or time is up."""
    import asyncio

    out: list[Event] = []
    async with EventConsumer(kafka, [topic], group_id=None, dead_letters=False) as consumer:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(out) < until and asyncio.get_running_loop().time() < deadline:
            out.extend(r.event for r in await consumer.getmany(timeout_ms=500))
    return out


def by_session(trajectories: Sequence[Event]) -> dict[str, list[Trajectory]]:
    grouped: dict[str, list[Trajectory]] = {}
    for event in trajectories:
        assert isinstance(event, Trajectory)
        grouped.setdefault(event.session_id, []).append(event)
    return grouped


def expected(plan: SessionPlan, *, partial: bool = False) -> Trajectory:
    end = None if partial else plan.end
    facts = SessionFacts(session_id=plan.session_id, task_id=plan.spec.task_id,
                         policy_version=plan.spec.policy_version, status=end.status if end else None,
                         failure=end.failure if end else None, partial=partial,
                         ended_at=end.occurred_at if end else None)
    return build_trajectory(plan.spec.builder, plan.completions, facts)


def same(got: Trajectory, want: Trajectory) -> None:
    assert got.event_id == want.event_id
    assert got.builder == want.builder and got.partial == want.partial
    assert got.session_status == want.session_status and got.task_id == want.task_id
    assert [t.model_dump(mode="json") for t in got.traces] == [t.model_dump(mode="json") for t in want.traces]
    assert got.stats == want.stats
    assert got.policy_versions == want.policy_versions and got.policy_version == want.policy_version
