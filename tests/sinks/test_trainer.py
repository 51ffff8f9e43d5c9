"""The reference online trainer (sinks/trainer.py): its loss and importance weights, its log-probabilities,
checkpoints that load back with the same logits, and ``rollwire train`` end to end for 2 steps against the
stand-in engine (dev mode) behind a real proxy, on the real broker.

torch is not in the project's environment: each check runs in a child Python that borrows it the way the
trainer does (``sinks.trainer.import_torch``: this environment's, else the vLLM environment's under
``$ROLLWIRE_CACHE_DIR``), so that this test process's ``transformers`` (imported by other tests without
torch) never has to see it. They are skipped only when neither environment has torch, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from sinks.trainer import borrowed_torch_site, prune_checkpoints

REPO = Path(__file__).resolve().parents[2]


def _torch_or_skip() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None and borrowed_torch_site() is None:
        reason = ("no torch here and no vLLM environment under $ROLLWIRE_CACHE_DIR to borrow it from "
                  "(`rollwire up` installs one)")
        print(f"skipping: {reason}")
        pytest.skip(reason)


def _child(code: str, *args: str, timeout_s: float = 300) -> dict[str, Any]:
    """Run ``code`` in a child Python (torch borrowed), return the JSON object it prints last."""
    _torch_or_skip()
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# A small random Qwen3 (the tiny model's architecture, smaller): built here, no model folder needed.
SMALL_MODEL = """
from sinks.trainer import import_torch
torch = import_torch()
import transformers

def small_model(seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      tie_word_embeddings=True, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
"""

LOSS = """
import json
from sinks.trainer import grpo_loss, import_torch
torch = import_torch()
# Two rows: context (mask 0) then sampled tokens. Row 0 on-policy; row 1 sampled by another policy.
mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
current = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.0, -0.2, 0.0]], requires_grad=True)
rollout = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.5, -3.0, 0.0]])
advantages = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -2.0, -2.0, 0.0]])
parts = grpo_loss(current, current.detach(), rollout, advantages, mask, clip_eps=0.2, is_cap=2.0)
parts.loss.backward()
print(json.dumps({"loss": float(parts.loss), "mean_ratio": float(parts.mean_ratio),
                  "truncated": float(parts.truncated), "grad": current.grad.tolist()}))
"""


def test_the_loss_weights_each_token_by_its_truncated_importance_ratio() -> None:
    out = _child(LOSS)
    # Weights: row 0 exp(0) = 1 each; row 1 exp(0.5) = 1.6487 and exp(2.8) = 16.44, capped at 2.
    w = [1.0, 1.0, 1.0, 1.6487212707, 2.0]
    a = [1.0, 1.0, 1.0, -2.0, -2.0]
    assert out["loss"] == pytest.approx(-sum(x * y for x, y in zip(w, a)) / 5, rel=1e-5)
    assert out["mean_ratio"] == pytest.approx((3 + 1.6487212707 + 16.444646771) / 5, rel=1e-5)
    assert out["truncated"] == pytest.approx(1 / 5)
    # On a single update the ratio is 1, so d loss / d logp = -w * A / tokens on trained tokens, 0 elsewhere.
    assert out["grad"][0] == pytest.approx([0.0, -0.2, -0.2, -0.2], abs=1e-6)
    assert out["grad"][1] == pytest.approx([0.0, 1.6487212707 * 2 / 5, 2.0 * 2 / 5, 0.0], rel=1e-5)


LOGPROBS = SMALL_MODEL + """
import json
from sinks.trainer import token_logprobs
model = small_model()
ids = torch.randint(1, 1024, (2, 9), generator=torch.Generator().manual_seed(1))
mask = torch.tensor([[0] * 4 + [1] * 5, [0] * 6 + [1] * 3])
positions = torch.arange(9)[None].repeat(2, 1)
with torch.no_grad():
    full = torch.log_softmax(model(ids).logits / 0.5, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    mine = token_logprobs(model, ids, torch.ones_like(ids), positions, mask, temperature=0.5)
expected = torch.nn.functional.pad(full, (1, 0)) * mask
print(json.dumps({"max_diff": float((mine - expected).abs().max()), "zeros_off_mask": bool((mine[mask == 0] == 0).all())}))
"""


def test_logprobs_are_computed_only_on_trained_tokens_and_match_the_full_softmax() -> None:
    out = _child(LOGPROBS)
    assert out["max_diff"] < 1e-5 and out["zeros_off_mask"]


CHECKPOINT = SMALL_MODEL + """
import json, sys
from pathlib import Path
from types import SimpleNamespace
from sinks.trainer import grpo_update, save_checkpoint
model = small_model()
model.train()
ids = torch.randint(1, 1024, (2, 8), generator=torch.Generator().manual_seed(2))
mask = torch.tensor([[0] * 3 + [1] * 5] * 2)
batch = SimpleNamespace(packed=False, input_ids=ids, attention_mask=torch.ones_like(ids),
                        position_ids=torch.arange(8)[None].repeat(2, 1), loss_mask=mask,
                        logprobs=torch.full((2, 8), -7.0) * mask, advantages=torch.tensor([[1.0], [-1.0]]) * mask)
before = model(ids).logits.detach()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
update = grpo_update(model, optimizer, batch)
folder = save_checkpoint(model, Path(sys.argv[1]), 3)
model.eval()
with torch.no_grad():
    trained = model(ids).logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits
from safetensors import safe_open
with safe_open(str(folder / "model.safetensors"), "pt") as f:
    names = sorted(f.keys())
with safe_open(str(folder / "model.safetensors"), "pt") as f:
    tied = bool((f.get_tensor("lm_head.weight") == f.get_tensor("model.embed_tokens.weight")).all())
print(json.dumps({"folder": str(folder), "files": sorted(p.name for p in folder.iterdir()), "names": names, "tied": tied,
                  "same": float((trained - loaded).abs().max()), "moved": float((trained - before).abs().max()),
                  "grad_norm": update.grad_norm, "trained_tokens": update.trained_tokens}))
"""


def test_a_checkpoint_is_a_hugging_face_folder_that_loads_back_with_the_same_logits(tmp_path: Path) -> None:
    out = _child(CHECKPOINT, str(tmp_path))
    assert out["folder"] == str(tmp_path / "policy-v3")
    assert {"config.json", "model.safetensors"} <= set(out["files"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the staging folder was renamed
    # vLLM's Qwen3 loader reads these names; the tied output layer is stored too (vLLM's CPU build keeps
    # its old lm_head on an in-place reload otherwise).
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(out["names"])
    assert out["grad_norm"] > 0 and out["trained_tokens"] == 10
    assert out["tied"] and out["moved"] > 1e-4 and out["same"] == 0.0


def test_pruning_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    for version in (1, 2, 10, 3):
        (tmp_path / f"policy-v{version}").mkdir()
    (tmp_path / "notes").mkdir()
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["policy-v1", "policy-v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "policy-v10", "policy-v3"]


WRITE_MODEL = SMALL_MODEL + """
import json, sys
small_model().save_pretrained(sys.argv[1])
print(json.dumps({"ok": True}))
"""


@pytest.mark.kafka
async def test_rollwire_train_steps_and_pushes_weights_through_the_proxy(kafka: Any, tmp_path: Path) -> None:
    """Two groups on `groups`, ``rollwire train --steps 2``: two steps, each checkpoint loaded by the engine
    behind the proxy (the stand-in in dev mode) as versions 1 and 2, in that order."""
    import asyncio

    import httpx

    from tests.support.standin_engine import Standin, StandinConfig
    from proxy.app import create_app
    from proxy.settings import ProxySettings
    from schemas.transport import EventProducer
    from tests.servers import serve
    from tests.sinks import group, trajectory

    model = tmp_path / "model"
    await asyncio.to_thread(_child, WRITE_MODEL, str(model))
    async with EventProducer(kafka) as producer:
        for t in range(2):
            built = [trajectory(f"tr-{t}-s{i}", f"tr-{t}", length=16, seed=t * 10 + i) for i in range(3)]
            await producer.send_many(built)
            await producer.send(group(f"tr-{t}", built, [1.0, -0.5, -0.5], rewards=[1.0, 0.0, 0.0]))
    engine = Standin(StandinConfig(latency_ms=1, reply_tokens=8, token_api=True, dev_mode=True, reload_ms=20))
    out = tmp_path / "checkpoints"
    with serve(engine.app()) as engine_url, \
            serve(create_app(ProxySettings(engine_url=engine_url, session_wait_s=1.0), kafka)) as proxy_url:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "deploy.cli", "train", "--proxy-url", proxy_url, "--steps", "2",
             "--group-size", "3", "--lr", "1e-3", "--model", str(model), "--out", str(out),
             "--group-id", f"trainer-{uuid.uuid4().hex[:8]}", "--idle-timeout-s", "60", "--max-staleness", "1"],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**os.environ, "PYTHONPATH": str(REPO), "ROLLWIRE_KAFKA_BOOTSTRAP": kafka.kafka_bootstrap,
                 "ROLLWIRE_TOPIC_PREFIX": kafka.topic_prefix})
        state = httpx.get(f"{proxy_url}/v1/policy", timeout=10).json()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [dict(kv.split("=", 1) for kv in line.split()) for line in done.stdout.splitlines()
             if line.startswith("step=")]
    assert [(s["step"], s["policy_version"], s["groups_used"]) for s in steps] == [("1", "1", "1"), ("2", "2", "1")]
    assert all(float(s["reward_mean"]) == pytest.approx(1 / 3, abs=1e-3) for s in steps), done.stdout
    assert float(steps[0]["grad_norm"]) > 0 and float(steps[0]["sync_s"]) > 0
    assert engine.loaded_paths == [str(out / "policy-v1"), str(out / "policy-v2")]
    assert engine.weight_version in ("2", "v2") and state["version"] in ("2", "v2")
    assert sorted(p.name for p in out.iterdir()) == ["policy-v1", "policy-v2"]
    assert "steps=2 policy_version=2" in done.stdout
