"""The SFT store: accepted trajectories as chat messages with token ids and loss masks, acceptance stats by
task, idempotent replays, and `rollwire export-sft` rebuilding a dataset `datasets` loads."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.evaluations import Evaluation
from schemas.transport import EventProducer, KafkaSettings
from sinks.sft import SftCriteria, SftStore
from tests.sinks import completion, evaluation, trajectory

REPO = Path(__file__).resolve().parents[2]

# task -> rewards of its sessions from the `tests` evaluator (None: the session was never given a trajectory)
REWARDS: dict[str, list[float | None]] = {"task-a": [1.0, 0.0, 1.0], "task-b": [0.0, 0.0, None]}


def _events() -> list:
    """Completions, trajectories and evaluations of five sessions, plus a sixth evaluated only."""
    events: list = []
    for task_id, rewards in REWARDS.items():
        for i, reward in enumerate(rewards):
            session_id = f"{task_id}-s{i}"
            first = completion(session_id, task_id, 0, user=f"fix {session_id}", answer="looking")
            last = completion(session_id, task_id, 1, user=f"fix {session_id}", answer=f"done {session_id}")
            events += [first, last]
            if reward is not None:
                # The trace merges both calls; its last completion (sequence 1) holds the whole conversation.
                events.append(trajectory(session_id, task_id, completion_ids=[first.event_id, last.event_id]))
            events.append(evaluation(session_id, task_id, reward if reward is not None else 0.0))
            # Another evaluator's verdict must not count for `tests`.
            events.append(evaluation(session_id, task_id, 1.0, evaluator="session_completed"))
    events.append(Evaluation(session_id="task-a-s1", task_id="task-a", evaluator="tests", status="error",
                             error="patch did not apply"))
    return events


_EVENTS = _events()  # one set of events (fixed ids), replayed


def _store(out: Path) -> SftStore:
    return SftStore(out, SftCriteria(min_reward=1.0, evaluator="tests"))


def test_accepted_traces_become_chat_rows_and_stats_count_attempts_by_task(tmp_path: Path) -> None:
    store = _store(tmp_path)
    # Trajectories before their completions: rows wait for the conversation instead of being lost.
    events = _events()
    for event in sorted(events, key=lambda e: e.event_type != "trajectory"):
        store.take(event)
    stats = store.finish()
    store.close()
    assert (stats["attempted"], stats["accepted"]) == (6, 2)
    assert stats["by_task"] == {"task-a": {"attempted": 3, "accepted": 2, "acceptance_rate": 0.6667},
                                "task-b": {"attempted": 3, "accepted": 0, "acceptance_rate": 0.0}}
    assert stats["evaluation_errors"] == 1 and stats["rows_without_messages"] == 0
    assert json.loads((tmp_path / "stats.json").read_text())["accepted"] == 2
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert sorted(r["session_id"] for r in rows) == ["task-a-s0", "task-a-s2"]
    row = next(r for r in rows if r["session_id"] == "task-a-s0")
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][-1]["content"] == "done task-a-s0"  # the last completion's reply, not the first
    assert row["messages"][-1]["tool_calls"][0]["function"] == {"name": "shell", "arguments": '{"command": "pytest"}'}
    source = next(e for e in events if e.event_type == "trajectory" and e.session_id == "task-a-s0")
    assert row["token_ids"] == source.traces[0].token_ids.tolist()
    assert row["loss_mask"] == source.traces[0].loss_mask.tolist()
    assert row["id"] == f"{source.event_id}:{source.traces[0].trace_id}"
    decisions = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert {d["reason"] for d in decisions if d["session_id"] == "task-b-s2"} == {"no trajectory"}


def test_replaying_into_the_same_directory_adds_nothing(tmp_path: Path) -> None:
    for _ in range(2):
        store = _store(tmp_path)
        for event in _EVENTS:
            store.take(event)
        stats = store.finish()
        store.close()
    assert (stats["attempted"], stats["accepted"], stats["rows"]) == (6, 2, 2)
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) == 2
    assert len((tmp_path / "decisions.jsonl").read_text().splitlines()) == 6


@pytest.mark.kafka
async def test_export_sft_rebuilds_a_dataset_that_datasets_loads(kafka: KafkaSettings, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    async with EventProducer(kafka) as producer:
        await producer.send_many(_events())
    out = tmp_path / "sft"
    env = {**os.environ, "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap,
           "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix, "ROLLWIRE_SESSION_PARTITIONS": str(kafka.session_partitions),
           "ROLLWIRE_TASK_PARTITIONS": str(kafka.task_partitions)}
    command = [sys.executable, "-m", "deploy.cli", "export-sft", "--from-beginning", "--min-reward", "1",
               "--evaluator", "tests", str(out)]
    for _ in range(2):  # the second replay must add nothing
        done = await asyncio.to_thread(subprocess.run, command, cwd=REPO, env=env, capture_output=True, text=True,
                                       timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    printed = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert (printed["attempted"], printed["accepted"], printed["acceptance_rate"]) == ("6", "2", "0.3333")
    assert printed["rows_skipped_by_role"] == "{}"
    rows = datasets.load_dataset("json", data_files=str(out / "sft.jsonl"), split="train")
    assert rows.num_rows == 2 and len(set(rows["id"])) == 2
    assert rows[0]["messages"][0]["role"] == "system"
    assert len(rows[0]["token_ids"]) == len(rows[0]["loss_mask"]) == 20
    table = datasets.load_dataset("parquet", data_files=str(out / "sft.parquet"), split="train")
    assert sorted(table["id"]) == sorted(rows["id"])
    stats = json.loads((out / "stats.json").read_text())
    assert stats["by_task"]["task-a"]["accepted"] == 2


def _with_side_trace(session_id: str = "task-c-s0", task_id: str = "task-c") -> list:
    """An accepted session whose trajectory has a main trace and a side trace (a title call)."""
    first = completion(session_id, task_id, 0, user=f"fix {session_id}", answer="looking")
    last = completion(session_id, task_id, 1, user=f"fix {session_id}", answer="done")
    built = trajectory(session_id, task_id, completion_ids=[first.event_id, last.event_id], traces=2)
    main, side = built.traces
    built = built.model_copy(update={"traces": [main, side.model_copy(update={"role": "side"})]})
    return [first, last, built, evaluation(session_id, task_id, 1.0)]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]


def test_side_traces_are_left_out_by_default_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLWIRE_SFT_ROLES", raising=False)
    store = _store(tmp_path)
    assert store.criteria.roles == {"main", "sub_agent"}
    for event in _with_side_trace():
        store.take(event)
    stats = store.finish()
    store.close()
    assert [r["trace_id"] for r in _rows(tmp_path)] == ["task-c-s0/0"]
    assert stats["rows"] == 1 and stats["rows_skipped_by_role"] == {"side": 1}
    assert stats["roles"] == ["main", "sub_agent"]


def test_side_traces_become_rows_when_their_role_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = SftStore(tmp_path / "explicit", SftCriteria(evaluator="tests", roles=frozenset({"main", "side"})))
    monkeypatch.setenv("ROLLWIRE_SFT_ROLES", "main, sub_agent,side")
    from_env = SftStore(tmp_path / "env", SftCriteria(evaluator="tests"))
    for store in (explicit, from_env):
        for event in _with_side_trace():
            store.take(event)
        stats = store.finish()
        store.close()
        assert sorted(r["trace_id"] for r in _rows(store.out_dir)) == ["task-c-s0/0", "task-c-s0/1"]
        assert stats["rows_skipped_by_role"] == {}
    assert from_env.criteria.roles == {"main", "sub_agent", "side"}


def test_export_sft_refuses_an_unknown_role(tmp_path: Path) -> None:
    """The role option is checked before Kafka is read: a typo exits 2 naming the known roles."""
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "export-sft", "--roles", "main,sidecar",
                           str(tmp_path / "sft")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "sidecar" in done.stderr and "sub_agent" in done.stderr
