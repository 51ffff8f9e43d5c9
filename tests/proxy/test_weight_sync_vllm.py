"""Weight sync through the proxy against the real vLLM CPU server (dev mode: ``deploy/engine/server.py``
sets ``VLLM_SERVER_DEV_MODE=1``): a perturbed copy of the tiny model is pushed with ``POST
/v1/policy/weights``; the call running then finishes on the old weights, a call made during the sync is
held and served on the new ones, every later completion carries the new version, and the engine's
logprobs are those the trainer side computes for the new checkpoint (transformers on CPU, run in the
vLLM environment's Python, which has torch), not those of the old one.

The tiny model ties its output layer to the embeddings. vLLM 0.32's CPU build refreshes the output
layer's pre-packed copy on a reload only when the checkpoint stores ``lm_head.weight`` (see
``proxy/weight_api.py``): checkpoints here store it, as a trainer must, and one without it is refused.

The engine is shared by the whole test run: the test puts the original weights and version back.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from deploy.engine.vllm_env import env_python, vllm_env_dir
from proxy.app import create_app
from schemas.completions import Completion
from schemas.policy import WeightsUpdated
from schemas.topics import Topic
from schemas.transport import EventConsumer, KafkaSettings
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

# The engine (vLLM's CPU kernels) against transformers' eager float32 forward pass over the same
# checkpoint: both float32, different kernels and summation orders. Observed: at most ~1e-6 apart on this
# model; the perturbation moves them by ~1e-1.
TOLERANCE = 1e-4
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the failing test in utils.py."}]

# Scores sampled ids under each checkpoint: {"models": {name: path}, "calls": [[prompt, sampled], ...]} on
# stdin; {name: [[logprob, ...], ...]} on stdout.
_SCORER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

job = json.load(sys.stdin)
torch.set_grad_enabled(False)
out = {}
for name, path in job["models"].items():
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    scores = []
    for prompt, sampled in job["calls"]:
        logits = model(torch.tensor([prompt + sampled])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        scores.append([float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(sampled)])
    out[name] = scores
print(json.dumps(out))
"""


def _served_folder(engine: httpx.Client) -> str:
    """The checkpoint folder vLLM serves (``root`` on ``/v1/models``)."""
    return engine.get("/v1/models").json()["data"][0]["root"]


def checkpoint(source: Path, target: Path, seed: int | None, *, tied_head: bool = True) -> Path:
    """A checkpoint: the model's files, every weight moved by noise of half its own spread (``seed``; None:
    unchanged), and ``lm_head.weight`` stored beside the embeddings it is tied to (``tied_head``)."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    if seed is not None:
        rng = np.random.default_rng(seed)
        tensors = {name: (w + rng.normal(0.0, 0.5 * float(w.std()) + 1e-3, w.shape)).astype(w.dtype)
                   for name, w in tensors.items()}
    if tied_head:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def score(models: dict[str, str], calls: list[tuple[list[int], list[int]]]) -> dict[str, list[list[float]]]:
    """Log-probabilities of each call's sampled ids under each checkpoint, by transformers on CPU."""
    cache = Path(os.environ.get("ROLLWIRE_CACHE_DIR", "~/.cache/rollwire")).expanduser()
    python = env_python(vllm_env_dir(cache))
    done = subprocess.run([str(python), "-c", _SCORER], input=json.dumps({"models": models, "calls": calls}),
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def restore_engine(vllm_url: str, folder: Path) -> None:
    """Put the engine back as the run's other tests expect it: its own weights (``folder``: a copy that
    stores lm_head.weight, so that the CPU build's output layer is restored too), vLLM's initial version."""
    with httpx.Client(base_url=vllm_url, timeout=300) as engine:
        engine.post("/pause", params={"mode": "wait"}).raise_for_status()
        try:
            engine.post("/collective_rpc", json={"method": "reload_weights",
                                                 "kwargs": {"weights_path": str(folder)}}).raise_for_status()
            engine.post("/update_weight_version", json={"new_version": "default"}).raise_for_status()
            engine.post("/reset_prefix_cache").raise_for_status()
        finally:
            engine.post("/resume").raise_for_status()


@contextmanager
def weights_pushing_proxy(kafka: KafkaSettings, vllm_url: str, tmp_path: Path,
                          engine_timeout_s: float) -> Iterator[ProxyUnderTest]:
    """A proxy over the shared engine that can push weights; the engine's own weights are put back after.
    Skips when the engine was started without its weight endpoints."""
    with httpx.Client(base_url=vllm_url, timeout=30) as engine:
        if engine.get("/weight_info").status_code == 404:
            pytest.skip("the engine under test was started without VLLM_SERVER_DEV_MODE=1 (reused through "
                        "ROLLWIRE_TEST_ENGINE_URL?): restart it so that its weight endpoints exist")
        original = checkpoint(Path(_served_folder(engine)), tmp_path / "original", None)
    try:
        with serve(create_app(proxy_settings(vllm_url, engine_timeout_s=engine_timeout_s,
                                             weight_update_timeout_s=300), kafka)) as url:
            yield ProxyUnderTest(url, kafka)
    finally:
        restore_engine(vllm_url, original)


@pytest.fixture
def synced_proxy(kafka: KafkaSettings, vllm_url: str, tmp_path: Path) -> Iterator[ProxyUnderTest]:
    with weights_pushing_proxy(kafka, vllm_url, tmp_path, engine_timeout_s=120) as proxy:
        yield proxy


async def _chat(session: dict, messages: list[dict], **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=300) as client:
        return await client.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session),
                                 json={"model": "m", "messages": messages, **body})


async def _paused_stream(session: dict, messages: list[dict], streaming: asyncio.Event,
                         resume: asyncio.Event) -> int:
    """A streamed call whose client stops reading after the first bytes (``streaming`` set) until ``resume``;
    returns its status once read whole. A small receive buffer keeps what the proxy can write meanwhile
    small."""
    transport = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    async with httpx.AsyncClient(timeout=300, transport=transport) as client:
        async with client.stream("POST", f"{session['base_urls']['openai']}/chat/completions",
                                 headers=auth(session),
                                 json={"model": "m", "messages": messages, "stream": True}) as response:
            async for _ in response.aiter_raw():
                if not streaming.is_set():
                    streaming.set()
                    await resume.wait()
            return response.status_code


async def _policy_events(kafka: KafkaSettings) -> list[WeightsUpdated]:
    async with EventConsumer(kafka, [Topic.POLICY], group_id=None, dead_letters=False) as consumer:
        return [r.event for r in await consumer.getmany(timeout_ms=3000) if isinstance(r.event, WeightsUpdated)]


def _calls(events: list[Completion]) -> list[tuple[list[int], list[int]]]:
    return [(e.prompt_token_ids.tolist(), e.token_ids.tolist()) for e in events]


async def test_pushed_weights_are_the_ones_that_sample(synced_proxy: ProxyUnderTest, vllm_url: str,
                                                       kafka: KafkaSettings, tmp_path: Path) -> None:
    proxy = synced_proxy
    with httpx.Client(base_url=vllm_url, timeout=30) as engine:
        folder = _served_folder(engine)
    new_weights = checkpoint(Path(folder), tmp_path / "step-1", seed=1)
    refused = httpx.post(f"{proxy.url}/v1/policy/weights", timeout=30, json={
        "weights_path": str(checkpoint(Path(folder), tmp_path / "no-head", seed=1, tied_head=False)),
        "version": "1"})
    assert refused.status_code == 422 and "lm_head.weight" in refused.json()["detail"], refused.text
    sampling = {"seed": 3, "temperature": 1.0, "max_tokens": 12}
    first = proxy.new_session(engine=sampling)
    # min_tokens: the long call must not end early on an end-of-sequence token (a random model may sample one).
    long_running = proxy.new_session(engine={"seed": 4, "temperature": 1.0, "max_tokens": 12000,
                                             "extra": {"min_tokens": 12000}})
    during = proxy.new_session(engine=sampling)

    before = await _chat(first, MESSAGES)
    assert before.status_code == 200, before.text
    assert httpx.get(f"{proxy.url}/v1/policy", timeout=10).json()["version"] == "0"

    # A long call is running when the update starts: the update drains it, a call made meanwhile is held.
    # Its client reads the first bytes and then waits until the other call is held: the proxy, unable to relay
    # more, stops reading the engine, so the call stays in flight however fast the engine samples (on a busy
    # machine the engine could finish before the update came, and nothing was drained).
    streaming, resume = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(_paused_stream(long_running, MESSAGES, streaming, resume))
    await asyncio.wait_for(streaming.wait(), 120)
    assert not running.done()
    update_began = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as client:
        update = asyncio.create_task(client.post(f"{proxy.url}/v1/policy/weights", json={
            "weights_path": str(new_weights), "version": "1"}))
        # Past its checks the update closes the gate: the running call drains. Here the update has reached
        # the proxy up to 30 s after it was sent while the engine sampled the long call (section "Tests and
        # benchmarks" of the README); the gate's wait is bounded by more than the engine's whole call.
        deadline = time.monotonic() + 120
        while not (await client.get(f"{proxy.url}/v1/policy")).json()["holding"]:
            assert time.monotonic() < deadline and not update.done(), "the update did not close the gate in time"
            await asyncio.sleep(0.01)
        assert not running.done() and not update.done()
        held = asyncio.create_task(_chat(during, MESSAGES))
        while not (await client.get(f"{proxy.url}/v1/policy")).json()["held_calls"]:
            assert time.monotonic() < deadline and not held.done(), "the call made during the update was not held"
            await asyncio.sleep(0.01)
        assert not update.done()  # still draining the running call, whose client reads on now
        resume.set()
        answer = await update
    update_took = time.monotonic() - update_began
    assert answer.status_code == 200, answer.text
    state = answer.json()
    assert state["version"] == "1" and state["updates"] == 1
    assert await running == 200
    held_reply = await held
    assert held_reply.status_code == 200, held_reply.text  # held, not failed

    text = before.json()["choices"][0]["message"]["content"]
    continued = await _chat(first, MESSAGES + [{"role": "assistant", "content": text},
                                               {"role": "user", "content": "Run the tests again."}])
    streamed = await _chat(proxy.new_session(engine=sampling), MESSAGES, stream=True)
    assert continued.status_code == 200 and streamed.status_code == 200

    events = {(e.session_id, e.sequence): e for e in await proxy.completions(5, timeout_s=60)}
    old_call = events[(first["session_id"], 0)]
    drained = events[(long_running["session_id"], 0)]
    held_call = events[(during["session_id"], 0)]
    new_calls = [held_call, events[(first["session_id"], 1)]] + [
        e for (session_id, _), e in events.items()
        if session_id not in (first["session_id"], long_running["session_id"], during["session_id"])]
    assert old_call.policy_version == "0" and drained.policy_version == "0"
    assert all(e.status == "ok" and e.policy_version == "1" for e in new_calls), \
        [(e.session_id, e.policy_version) for e in new_calls]
    exact = events[(first["session_id"], 1)]
    assert exact.continuation is not None and exact.continuation.mode == "exact"
    assert exact.weight_versions == [{"version": "1", "start": 0, "end": len(exact.token_ids)}]

    [update_event] = await _policy_events(kafka)
    assert (update_event.status, update_event.version, update_event.previous_version) == ("ok", "1", "0")
    assert update_event.drained_calls == 1 and update_event.held_calls >= 1
    print(f"update: {update_took * 1000:.0f} ms end to end, calls held {update_event.paused_ms:.0f} ms "
          f"(of which loading {update_event.load_ms:.0f} ms, draining the running call the rest)")

    scored = await asyncio.to_thread(score, {"new": str(new_weights), "old": folder},
                                     _calls([old_call] + new_calls))
    engine_old = np.array(old_call.logprobs.tolist())
    engine_new = np.concatenate([np.array(e.logprobs.tolist()) for e in new_calls])
    trainer_new = np.concatenate([np.array(s) for s in scored["new"][1:]])
    trainer_old_on_new_ids = np.concatenate([np.array(s) for s in scored["old"][1:]])
    print(f"engine vs trainer, new weights: max |diff| {np.abs(engine_new - trainer_new).max():.2e} over "
          f"{len(engine_new)} tokens; old weights on the same ids differ by up to "
          f"{np.abs(engine_new - trainer_old_on_new_ids).max():.2e}")
    assert np.abs(engine_old - np.array(scored["old"][0])).max() <= TOLERANCE  # the scorer agrees before, too
    assert np.abs(engine_new - trainer_new).max() <= TOLERANCE
    assert np.abs(engine_new - trainer_old_on_new_ids).max() > 100 * TOLERANCE


async def test_pause_without_traffic_is_short(synced_proxy: ProxyUnderTest, vllm_url: str, tmp_path: Path) -> None:
    """With nothing to drain, calls are held only while the engine pauses, loads, and resumes: the figure
    a trainer pays per push on this model (printed; bounded loosely for a loaded 2-core machine)."""
    with httpx.Client(base_url=vllm_url, timeout=30) as engine:
        folder = Path(_served_folder(engine))
    paused = []
    for version in (1, 2, 3):
        weights = checkpoint(folder, tmp_path / f"step-{version}", seed=version)
        answer = httpx.post(f"{synced_proxy.url}/v1/policy/weights", timeout=300,
                            json={"weights_path": str(weights), "version": str(version)})
        assert answer.status_code == 200, answer.text
        paused.append(answer.json()["last_paused_ms"])
    print(f"calls held per push, no traffic: {', '.join(f'{ms:.0f}' for ms in paused)} ms")
    assert max(paused) < 10_000
