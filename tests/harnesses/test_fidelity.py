"""The six real CLIs, unforced, on the real vLLM CPU build, in ``exact`` and in ``rendered`` mode (what
``bench.fidelity`` measures, once per harness and mode): in exact mode every continued call's prompt extends
its parent's prompt + sampled ids, and each session builds exactly one trace per agent branch."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.fidelity import DEFAULT_TASKS, HARNESSES, MODES, collect
from producers.rollout.taskfile import load_tasks
from tests.harnesses.common import assert_exact_continuations

pytestmark = pytest.mark.kafka


async def test_real_clis_continue_exactly_and_build_one_row_per_branch(kafka_bootstrap: str, vllm_url: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWIRE_KAFKA_BOOTSTRAP", kafka_bootstrap)
    args = argparse.Namespace(engine_url=vllm_url, modes=list(MODES), samples=1, max_tokens=48, timeout_s=240.0,
                              run_slots=4)
    tasks = [line.request for line in load_tasks(DEFAULT_TASKS)[0]]
    results, _ = await collect(HARNESSES, tasks, args)
    assert len(results) == len(HARNESSES) * len(MODES)
    continued = 0
    for result in results.values():
        name = f"{result.sample.harness}/{result.sample.mode}"
        assert result.ended is not None, f"{name} did not end"
        usable = result.usable()
        assert usable, f"{name} made no usable call: {result.ended}"
        assert all(c.continuation is not None and c.continuation.opened != "engine_has_no_token_api"
                   for c in usable), name
        if result.sample.mode != "exact":
            assert all(c.continuation.mode == "rendered" for c in usable), name
            continue
        assert_exact_continuations(usable)
        continued += sum(1 for c in usable if c.continuation.mode == "exact")
        trajectory = result.trajectory
        assert trajectory is not None
        # One row per agent branch: the traces of role main or sub_agent and the branches of their calls (the
        # traces' roles: opencode's title call, recorded as main before the agent's first call, is a side trace).
        agent = [t for t in trajectory.traces if t.role in ("main", "sub_agent")]
        in_agent = {s for t in agent for s in t.sequences}
        branches = {c.continuation.branch for c in usable if c.sequence in in_agent}
        assert agent and len(agent) == len(branches), (name, len(agent), branches, trajectory.stats.problems)
    # Claude Code and Qwen Code go on after a cut reply: their later calls are exact continuations.
    assert continued > 0
    if os.environ.get("ROLLWIRE_VERBOSE_FIDELITY"):
        for result in results.values():
            print(result.sample.harness, result.sample.mode, len(result.usable()),
                  len(result.trajectory.traces) if result.trajectory else None)
