"""The TRL bridge (sinks/bridges/trl.py): TRL 1.16's real GRPOTrainer takes a step on rows recorded through
the proxy from the real vLLM CPU engine, then pushes its weights back through the proxy, which the engine
then serves; and the bad-input rules of sinks/bridges/rows.py.

TRL is installed from PyPI (deploy/rollwire.sh: without its torch); torch is borrowed from the vLLM
environment, so the steps run in a child Python (as tests/sinks/test_trainer.py does) and this test
process's ``transformers`` never has to see torch. The engine is shared by the whole test run: the
fixture puts its original weights and version back.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from processors.builders.common import SessionFacts
from processors.builders.prefix_merging import build
from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import EventProducer, KafkaSettings
from sinks.bridges.rows import Row, RowCounts, read_rl_rows, usable_rows, write_rl_rows
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.proxy.test_weight_sync_vllm import score, weights_pushing_proxy
from tests.servers import serve
from tests.sinks import group

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the failing test in utils.py."}]
TOOL_OUTPUT = "$ pytest -q\n1 failed, 3 passed in 0.02s"
SAMPLES = 3


def _trl_or_skip() -> None:
    from sinks.trainer import borrowed_torch_site

    if importlib.util.find_spec("trl") is None:
        pytest.fail("TRL is not installed: deploy/rollwire.sh installs it (pip install --no-deps trl==1.16.0)")
    if importlib.util.find_spec("torch") is None and borrowed_torch_site() is None:
        pytest.skip("no torch here and no vLLM environment to borrow it from")


def _child(code: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 900) -> dict[str, Any]:
    """Run ``code`` in a child Python (torch borrowed), return the JSON object it prints last."""
    _trl_or_skip()
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the bad-input rules (numpy only) ----------------------------------------------------------------------


def _row(session: str, group_id: str, length: int = 10, prompt: int = 4, advantage: float = 1.0,
         logprobs: bool = True) -> Row:
    mask = np.r_[np.zeros(prompt), np.ones(length - prompt)].astype(np.int8)
    values = np.where(mask == 1, -1.0, np.nan) if logprobs else np.full(length, np.nan)
    return Row(input_ids=np.arange(length, dtype=np.int64) + 10, loss_mask=mask,
               logprobs=values.astype(np.float32), advantage=advantage, group_id=group_id, session_id=session)


def test_bad_rows_are_dropped_or_cut_and_counted_never_raised() -> None:
    counts = RowCounts()
    rows = [
        _row("a1", "a"), _row("a2", "a", logprobs=False),                   # group a: one usable sample left
        _row("b1", "b", length=30), _row("b2", "b"), _row("b2", "b"),      # b1 too long; b2 has two branches
        _row("c1", "c", length=30, prompt=25), _row("c2", "c"),            # c1's trained tokens lie past the cut
        _row("d1", "d", advantage=math.nan), _row("d2", "d"), _row("d3", "d"),
    ]
    kept = usable_rows(rows, counts, max_length=20, min_group_sessions=2)
    assert [r.session_id for r in kept] == ["b1", "b2", "b2", "d2", "d3"]
    cut = kept[0]
    assert len(cut) == 20 and cut.loss_mask.tolist() == [0] * 4 + [1] * 16
    assert counts.as_dict() == {"rows": 10, "rows_used": 5, "rows_without_logprobs": 1,
                                "rows_without_trained_tokens": 1, "rows_without_advantage": 1,
                                "rows_truncated": 2, "groups_too_small": 2, "tokens_without_logprob": 6}


def test_an_rl_rows_file_reads_back_row_for_row(tmp_path: Path) -> None:
    rows = [_row("a1", "a"), _row("a2", "a", logprobs=False, advantage=-1.0)]
    write_rl_rows(tmp_path / "rows.jsonl", rows)
    back = list(read_rl_rows(tmp_path / "rows.jsonl"))
    assert [r.session_id for r in back] == ["a1", "a2"]
    assert back[0].logprobs[4:].tolist() == [-1.0] * 6 and np.isnan(back[1].logprobs).all()
    assert back[1].advantage == -1.0 and back[0].loss_mask.tolist() == rows[0].loss_mask.tolist()


def test_the_trl_pin_is_one_version_everywhere() -> None:
    """The bridge overrides TRL's private methods: the extra users install, the version CI installs and the
    version the bridge accepts must be the same."""
    import tomllib

    from sinks.bridges.trl import TRL_VERSION

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    assert f"trl=={TRL_VERSION}" in extra
    assert f'"trl=={TRL_VERSION}"' in (REPO / "deploy" / "rollwire.sh").read_text()


# -- a real TRL step on rows recorded through the proxy ----------------------------------------------------


@pytest.fixture
def weights_proxy(kafka: KafkaSettings, vllm_url: str, tmp_path: Path) -> Iterator[ProxyUnderTest]:
    """A proxy over the shared engine that can push weights; the engine's own weights are put back after."""
    with weights_pushing_proxy(kafka, vllm_url, tmp_path, engine_timeout_s=300) as proxy:
        yield proxy


def _ask(session: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                          json={"model": "m", "messages": messages}, timeout=300)
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0]["message"])


def _two_turns(proxy: ProxyUnderTest, seed: int) -> str:
    """A session of two calls: the reply, then a command's output as the next user turn (interstitial
    tokens the model did not sample), then the second reply."""
    session = proxy.new_session(engine={"seed": seed, "temperature": 1.0, "max_tokens": 6})
    first = _ask(session, MESSAGES)
    _ask(session, [*MESSAGES, {"role": "assistant", "content": first.get("content") or ""},
                   {"role": "user", "content": TOOL_OUTPUT}])
    return str(session["session_id"])


STEP = """
import json, os, sys
from pathlib import Path
from sinks.trainer import import_torch
torch = import_torch()
from transformers import AutoModelForCausalLM, AutoTokenizer
from sinks.bridges.trl import FeedRows, TrlBridgeConfig, grpo_config, rollwire_grpo_trainer
from sinks.feed import BatchConfig, ReadConfig, TrainerFeed

model_dir, proxy_url, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
before = {k: v.detach().clone() for k, v in model.state_dict().items()}
feed = TrainerFeed(ReadConfig(group_id=sys.argv[4]), BatchConfig(token_budget=4096, tensors="torch", linger_s=0.5,
                   idle_timeout_s=60), policy_version=0)
with feed:
    trainer = rollwire_grpo_trainer(model, tokenizer, FeedRows(feed), grpo_config(out / "trl", max_steps=1,
                                    learning_rate=1e-3, temperature=1.0),
                                    TrlBridgeConfig(proxy_url=proxy_url, out=out))
    trainer.train()
step = trainer.steps[0]
inputs, rows = trainer.last_inputs, trainer.last_rows
split = inputs["prompt_ids"].shape[1]
masks = {}
for i, row in enumerate(rows):
    used = [0] * split + inputs["tool_mask"][i].tolist()
    masks[row.trace_id] = used[:len(row)]
moved = max(float((model.state_dict()[k] - before[k]).abs().max()) for k in before)
print(json.dumps({"loss": step.loss, "is_ratio": step.is_ratio_mean, "is_min": step.is_ratio_min,
                  "is_max": step.is_ratio_max, "trained_tokens": step.trained_tokens,
                  "masked_tokens": step.masked_tokens, "moved": moved, "version": step.policy_version,
                  "checkpoint": str(step.checkpoint), "masks": masks, "acked": feed.stats.acked_batches}))
"""


async def test_a_trl_grpo_step_on_recorded_rows_pushes_weights_the_engine_serves(
        weights_proxy: ProxyUnderTest, kafka: KafkaSettings, tmp_path: Path) -> None:
    """Three two-turn sessions through the proxy on the real engine, merged by the prefix-merging builder,
    a GRPO group over them; TRL's GRPOTrainer (the bridge) takes one step from the feed: the loss is finite,
    the weights move, TRL's mask is 0 exactly where the trajectory's is (prompt, the command's output,
    template glue), the importance ratio is 1 (the engine sampled with the weights being trained); the
    pushed checkpoint is what the engine then samples with."""
    _trl_or_skip()
    proxy = weights_proxy
    sessions = [await asyncio.to_thread(_two_turns, proxy, seed) for seed in range(SAMPLES)]
    completions = await proxy.completions(2 * SAMPLES, timeout_s=60)
    trajectories = []
    for session_id in sessions:
        calls: list[Completion] = [c for c in completions if c.session_id == session_id]
        built = build(calls, SessionFacts(session_id=session_id, task_id="trl-task"))
        assert len(built.traces) == 1, "the second call continues the first: one branch"
        trajectories.append(built)
    trace = trajectories[0].traces[0]
    mask = np.asarray(trace.loss_mask)
    spans = np.flatnonzero(np.diff(np.r_[0, mask, 0]))  # starts and ends of the sampled spans
    assert len(spans) == 4, "two sampled spans with the prompt, output and template glue around them"
    async with EventProducer(kafka) as producer:
        await producer.send_many(trajectories)
        await producer.send(group("trl-task", trajectories, [1.0, -0.5, -0.5], rewards=[1.0, 0.0, 0.0]))

    model = Path(os.environ.get("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire")).expanduser() / "models" / "tiny-qwen3-seed0"
    out = tmp_path / "checkpoints"
    env = {"ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap, "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix}
    result = await asyncio.to_thread(_child, STEP, str(model), proxy.url, str(out), f"trl-{uuid.uuid4().hex[:8]}",
                                     env=env)
    print("trl step:", {k: v for k, v in result.items() if k != "masks"})
    assert math.isfinite(result["loss"]) and result["moved"] > 0
    assert abs(result["is_ratio"] - 1) < 1e-3 and abs(result["is_min"] - 1) < 1e-3 and abs(result["is_max"] - 1) < 1e-3
    assert result["version"] == 1 and result["acked"] == 1
    for built in trajectories:
        t = built.traces[0]
        expected = (np.asarray(t.loss_mask) == 1) & ~np.isnan(np.asarray(t.logprobs, dtype=np.float64))
        assert result["masks"][t.trace_id] == expected.astype(int).tolist()
    assert result["trained_tokens"] == sum(int(np.asarray(t.traces[0].loss_mask).sum()) for t in trajectories)

    # The engine now serves the pushed checkpoint: its logprobs are transformers' over that folder.
    state = httpx.get(f"{proxy.url}/v1/policy", timeout=10).json()
    assert state["version"] in ("1", "v1")
    after = proxy.new_session(engine={"seed": 7, "temperature": 1.0, "max_tokens": 6})
    await asyncio.to_thread(_ask, after, MESSAGES)
    served = [c for c in await proxy.completions(2 * SAMPLES + 1, timeout_s=60) if c.session_id == after["session_id"]]
    assert served and served[0].policy_version in ("1", "v1")
    call = (served[0].prompt_token_ids.tolist(), served[0].token_ids.tolist())
    expected_lp = await asyncio.to_thread(score, {"pushed": result["checkpoint"]}, [call])
    engine_lp = np.asarray(served[0].logprobs, dtype=np.float64)
    assert np.abs(engine_lp - np.asarray(expected_lp["pushed"][0])).max() < 1e-4


# -- offline SFT with TRL's SFTTrainer on the SFT store's rows ---------------------------------------------

SFT_STEP = """
import json, sys
from pathlib import Path
from sinks.trainer import import_torch
torch = import_torch()
from transformers import AutoModelForCausalLM, AutoTokenizer
from sinks.bridges.trl_sft import SftCounts, rollwire_sft_trainer, sft_config, sft_records

model_dir, rows = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
records = sft_records(rows)
with torch.no_grad():  # the causal LM loss over the trained tokens only, by hand, before the step
    total, count = 0.0, 0
    for r in records:
        logp = torch.log_softmax(model(torch.tensor([r["input_ids"]])).logits[0].float(), dim=-1)
        for t in range(1, len(r["input_ids"])):
            if r["assistant_masks"][t]:
                total -= float(logp[t - 1, r["input_ids"][t]])
                count += 1
before = {k: v.detach().clone() for k, v in model.state_dict().items()}
counts = SftCounts()
trainer = rollwire_sft_trainer(model, tokenizer, rows, sft_config(Path(sys.argv[3]), max_steps=1,
                               per_device_train_batch_size=len(records), learning_rate=1e-3), counts)
labels = [list(map(int, l)) for l in trainer.train_dataset["labels"]]
trainer.train()
moved = max(float((model.state_dict()[k] - before[k]).abs().max()) for k in before)
print(json.dumps({"manual": total / count, "logged": trainer.state.log_history[0]["loss"], "labels": labels,
                  "records": records, "moved": moved, "counts": [counts.rows, counts.rows_used]}))
"""


def test_sft_trainer_trains_the_sft_store_rows_only_on_the_model_tokens(tmp_path: Path, vllm_url: str) -> None:
    """The SFT store's rows (accepted trajectories, written by sinks/sft.py) through TRL's SFTTrainer: one
    real step whose loss is the causal LM loss of the tokens rollwire's mask marks, computed by hand,
    with labels -100 exactly where the mask is 0. ``vllm_url``: the vLLM environment (torch) and the
    tiny model are installed."""
    from sinks.sft import SftCriteria, SftStore
    from tests.sinks import completion, evaluation, trajectory

    store = SftStore(tmp_path / "sft", SftCriteria(min_reward=1.0, evaluator="tests"))
    for i, reward in enumerate([1.0, 1.0, 0.0]):
        session = f"sft-s{i}"
        call = completion(session, "sft-task", 0, user="Fix it.", answer=f"done {i}")
        store.take(call)
        store.take(trajectory(session, "sft-task", length=24, prompt=9, seed=i, completion_ids=[call.event_id]))
        store.take(evaluation(session, "sft-task", reward))
    store.finish()
    store.close()
    rows = tmp_path / "sft" / "sft.jsonl"
    model = Path(os.environ.get("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire")).expanduser() / "models" / "tiny-qwen3-seed0"
    out = _child(SFT_STEP, str(model), str(rows), str(tmp_path / "out"))
    print("sft step:", {k: out[k] for k in ("manual", "logged", "moved", "counts")})
    assert out["counts"] == [2, 2]  # the two accepted sessions' traces
    assert out["logged"] == pytest.approx(out["manual"], rel=1e-4) and out["moved"] > 0
    for record, labels in zip(out["records"], out["labels"]):
        assert labels == [t if m else -100 for t, m in zip(record["input_ids"], record["assistant_masks"])]
        assert record["assistant_masks"] == [0] * 9 + [1] * 15


# -- the async trainer's adapters (the trainer itself needs CUDA) ------------------------------------------

ASYNC_ADAPTERS = """
import json, sys
from pathlib import Path
import numpy as np
from sinks.trainer import import_torch
torch = import_torch()
import transformers
from sinks.bridges.rows import Row
from sinks.bridges.trl import FileRows
from sinks.bridges.rows import write_rl_rows
from sinks.bridges.trl_async import FeedRolloutWorker, PolicyApiWeightTransfer

rows_file, proxy_url, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
def row(session, branch, advantage, logprobs=True):
    mask = np.array([0, 0, 0, 1, 1, 0, 0, 1], dtype=np.int8)
    lp = np.where(mask == 1, -0.5, np.nan) if logprobs else np.full(8, np.nan)
    return Row(np.arange(8) + 20, mask, lp.astype(np.float32), advantage, "g-1", session, f"{session}/{branch}")
write_rl_rows(rows_file, [row("s1", 0, 1.0), row("s1", 1, 1.0), row("s2", 0, -1.0), row("s3", 0, 0.0, False)])
worker = FeedRolloutWorker(FileRows(rows_file))
worker.update_model_version(3)
worker.start()
samples = [worker.rollout_buffer.get(timeout=30) for _ in range(3)]
worker.stop()
torch.manual_seed(0)
config = transformers.Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
transfer = PolicyApiWeightTransfer(proxy_url, out, model.config)
transfer.init_weight_transfer(); transfer.pause()
transfer.send_weights(iter(model.state_dict().items()))
transfer.resume()
ids = torch.arange(10)[None]
loaded = transformers.AutoModelForCausalLM.from_pretrained(transfer.pushed[0], dtype=torch.float32).eval()
with torch.no_grad():
    same = float((model(ids).logits - loaded(ids).logits).abs().max())
print(json.dumps({"samples": [{"ids": s.input_ids.tolist(), "mask": s.completion_mask.tolist(),
                               "old": s.old_log_probs.tolist(), "advantage": s.advantage, "version": s.model_version,
                               "group": s.group_id} for s in samples],
                  "counts": worker.counts.as_dict(), "pushed": [str(p) for p in transfer.pushed], "same": same}))
"""


@pytest.mark.kafka
async def test_async_trainer_adapters_queue_rollout_samples_and_push_weights(kafka: KafkaSettings,
                                                                            tmp_path: Path) -> None:
    """The rollout worker turns rows (two branches of one session, a row without logprobs) into TRL's own
    ``RolloutSample`` objects; the weight transfer writes the streamed tensors as a folder the engine behind
    a real proxy (the stand-in, dev mode) loads, and which loads back with the same logits."""
    from tests.support.standin_engine import Standin, StandinConfig

    engine = Standin(StandinConfig(latency_ms=1, reply_tokens=8, token_api=True, dev_mode=True, reload_ms=20))
    with serve(engine.app()) as engine_url, \
            serve(create_app(proxy_settings(engine_url, session_wait_s=1.0), kafka)) as proxy_url:
        out = await asyncio.to_thread(_child, ASYNC_ADAPTERS, str(tmp_path / "rows.jsonl"), proxy_url,
                                      str(tmp_path / "ckpt"))
    samples = out["samples"]
    assert [s["advantage"] for s in samples] == [1.0, 1.0, -1.0]
    assert all(s["mask"] == [0, 0, 0, 1, 1, 0, 0, 1] and s["version"] == 3 for s in samples)
    assert samples[0]["old"] == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5] and len({s["group"] for s in samples}) == 1
    assert out["counts"]["rows_without_logprobs"] == 1 and out["counts"]["rows_used"] == 3
    assert out["pushed"] == [str(tmp_path / "ckpt" / "policy-v1")] and engine.loaded_paths == out["pushed"]
    assert out["same"] == 0.0


# -- bad input through a whole run -------------------------------------------------------------------------

BAD_RUN = """
import json, sys
from pathlib import Path
from sinks.trainer import import_torch
torch = import_torch()
from transformers import AutoModelForCausalLM, AutoTokenizer
from sinks.bridges.trl import FeedRows, TrlBridgeConfig, grpo_config, rollwire_grpo_trainer
from sinks.feed import BatchConfig, ReadConfig, StalenessConfig, TrainerFeed

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
feed = TrainerFeed(ReadConfig(group_id=sys.argv[3]), BatchConfig(token_budget=4096, max_groups=1, linger_s=0.5,
                   idle_timeout_s=15), staleness=StalenessConfig(max_staleness=1), policy_version=5)
source = FeedRows(feed)
with feed:
    trainer = rollwire_grpo_trainer(model, tokenizer, source, grpo_config(out / "trl", max_steps=10),
                                    TrlBridgeConfig(out=out, max_length=32, start_version=5))
    trainer.train()
print(json.dumps({"steps": [s.rows for s in trainer.steps], "counts": trainer.counts.as_dict(),
                  "stale": feed.stats.stale_skipped, "acked": feed.stats.acked_batches,
                  "versions": [s.policy_version for s in trainer.steps], "missing": source.missing_logprobs}))
"""


@pytest.mark.kafka
async def test_bad_input_is_counted_and_the_run_goes_on(kafka: KafkaSettings, tmp_path: Path) -> None:
    """Through the feed and a whole TRL run: a stale group (dropped by the feed), a group with one usable
    sample (the others failed: dropped by the bridge), and a group with a row without logprobs and a row
    longer than ``max_length`` (dropped, and cut with its mask): only the usable rows are trained on, each
    case counted, every batch acknowledged, no crash."""
    from deploy.engine.tiny_model import build_tiny_model
    from tests.sinks import trajectory

    _trl_or_skip()
    cache = Path(os.environ.get("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire")).expanduser()
    model = await asyncio.to_thread(build_tiny_model, cache / "models" / "tiny-qwen3-seed0")
    stale = [trajectory(f"stale-s{i}", "stale", seed=i, versions=(1, 1)) for i in range(3)]
    lonely = [trajectory(f"lonely-s{i}", "lonely", seed=10 + i, versions=(5, 5)) for i in range(3)]
    mixed = [trajectory(f"mixed-s{i}", "mixed", seed=20 + i, versions=(5, 5), length=20 if i else 40)
             for i in range(4)]
    blind = mixed[3].traces[0].model_copy(update={"logprobs": np.full(20, np.nan, dtype=np.float32)})
    mixed[3] = mixed[3].model_copy(update={"traces": [blind]})
    async with EventProducer(kafka) as producer:
        await producer.send_many([*stale, *lonely, *mixed])
        await producer.send(group("stale", stale, [1.0, -0.5, -0.5]))
        await producer.send(group("lonely", lonely, [1.0, None, None]))
        await producer.send(group("mixed", mixed, [1.0, -1.0, 0.5, -0.5]))
    env = {"ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap, "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix}
    out = await asyncio.to_thread(_child, BAD_RUN, str(model), str(tmp_path), f"trl-{uuid.uuid4().hex[:8]}", env=env)
    assert out["stale"] == 1
    assert out["steps"] == [3] and out["versions"] == [6]  # the mixed group's three rows with logprobs
    counts = out["counts"]
    # The feed leaves tokens without a logprob out of the mask (and counts them): that row comes with none.
    assert (counts["groups_too_small"], counts["rows_without_trained_tokens"], counts["rows_truncated"]) == (1, 1, 1)
    assert out["missing"] == 12  # the blind row's 20 - 8 sampled tokens
    assert out["acked"] == 2  # the lonely group's batch (passed over) and the step's


OFFLINE = """
import json, sys
from pathlib import Path
import numpy as np
from sinks.trainer import import_torch
torch = import_torch()
from transformers import AutoModelForCausalLM, AutoTokenizer
from sinks.bridges.rows import Row, write_rl_rows
from sinks.bridges.trl import FileRows, TrlBridgeConfig, grpo_config, rollwire_grpo_trainer

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
rng = np.random.default_rng(0)
rows = []
for g in range(3):
    for s, advantage in enumerate([1.0, -0.5, -0.5]):
        mask = np.r_[np.zeros(6), np.ones(4), np.zeros(3), np.ones(3)].astype(np.int8)
        rows.append(Row(rng.integers(10, 1000, 16), mask, np.where(mask == 1, -3.0, np.nan).astype(np.float32),
                        advantage, f"g{g}", f"g{g}s{s}"))
write_rl_rows(out / "rows.jsonl", rows)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
trainer = rollwire_grpo_trainer(model, AutoTokenizer.from_pretrained(model_dir), FileRows(out / "rows.jsonl"),
                                grpo_config(out / "trl", max_steps=10), TrlBridgeConfig(out=out / "ckpt"))
trainer.train()
print(json.dumps({"steps": [(s.rows, s.groups, s.trained_tokens, s.policy_version) for s in trainer.steps],
                  "folders": sorted(p.name for p in (out / "ckpt").iterdir()),
                  "is_ratio": [s.is_ratio_mean for s in trainer.steps]}))
"""


def test_offline_grpo_from_an_rl_rows_file_steps_once_per_group_and_saves(tmp_path: Path) -> None:
    """Offline: an RL rows file of three groups, one step each, until the file ends (before ``max_steps``);
    each step's checkpoint saved (no proxy), the newest two kept. The rows' logprobs are not the model's,
    so the importance ratio is far from 1 (the weights then truncated at the cap)."""
    from deploy.engine.tiny_model import build_tiny_model

    _trl_or_skip()
    cache = Path(os.environ.get("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire")).expanduser()
    model = build_tiny_model(cache / "models" / "tiny-qwen3-seed0")
    out = _child(OFFLINE, str(model), str(tmp_path))
    assert out["steps"] == [[3, 1, 21, 1], [3, 1, 21, 2], [3, 1, 21, 3]]
    assert out["folders"] == ["policy-v2", "policy-v3"]
    assert all(ratio != pytest.approx(1.0, abs=1e-3) for ratio in out["is_ratio"])
