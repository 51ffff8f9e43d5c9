"""The UI in headless Chromium against a real run on the real broker.

A run's sessions go through the real proxy (stand-in engine with vLLM's token endpoints, so calls are
exactly continued and written as prompt deltas), the real trajectory worker builds their traces, and the
session lifecycle, evaluations and the group are written by the project's own producer. The UI reads the
topics itself; Debian's ``chromium``, driven over the DevTools protocol (bench/ui.py), checks that:

- the run page lists the run's sessions with their timelines and failure kinds, and shows a session
  that appears later without a reload (live);
- the session page lists every call (in order, with its branch and why a branch opened) and the branch
  tree the builder made;
- the trace page shades exactly the tokens whose loss mask is 1 (the trajectory read from the broker),
  and hovering a token shows its id and call;
- a 100-call session with a 200,000-token trace lists its calls, and its trace page keeps only the rows
  in view in the document while scrolling to the end shows the last token.

Screenshots go to the test's tmp dir and, when set, to ``$ROLLWIRE_UI_SCREENSHOTS``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.standin_engine import StandinConfig, create_app as create_standin
from tests.support.standin_tokens import IM_END, IM_START
from bench.ui import Chromium, Page, chromium_path, long_session
from proxy.app import create_app as create_proxy
from schemas.evaluations import Evaluation
from schemas.groups import Group, GroupSample
from schemas.sessions import SessionStage, SessionStageChanged
from schemas.tasks import AgentSpec, TaskAccepted, TaskRequest
from schemas.topics import Topic
from schemas.trajectories import Trajectory
from schemas.transport import EventProducer, KafkaSettings
from sinks.ui.app import create_app as create_ui
from schemas.ui_links import run_url, session_url, trace_url
from sinks.ui.tokens import TokenDecoder, decoder_from_env
from sinks.ui.view import RunView
from tests.processors.worker_process import WorkerProcess, read_events
from tests.proxy.conftest import auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka


@pytest.fixture(autouse=True)
def _chromium() -> None:
    # Not a skip: a browser is software that installs anywhere, not missing hardware.
    if chromium_path() is None:
        pytest.fail("no chromium: `apt-get install -y chromium` (Debian's package; .ci/run installs it), or "
                    "set ROLLWIRE_CHROMIUM to a Chromium binary")

RUN_ID = "2611240900ab"
TASK_ID = f"fix-r{RUN_ID}"
SYSTEM = {"role": "system", "content": "You are terse."}


def ask(session: dict, messages: list[dict]) -> dict:
    """One chat call through the proxy; the assistant message to append to the history."""
    response = httpx.post(f"{session['base_urls']['openai']}/chat/completions", headers=auth(session), timeout=30,
                          json={"model": "m", "messages": messages})
    assert response.status_code == 200, response.text
    return {"role": "assistant", "content": response.json()["choices"][0]["message"].get("content") or ""}


class Shots:
    """Where the screenshots go: the test's tmp dir, and $ROLLWIRE_UI_SCREENSHOTS when set."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        configured = os.environ.get("ROLLWIRE_UI_SCREENSHOTS")
        self.extra = Path(configured) if configured else None

    async def take(self, page: Page, name: str) -> Path:
        path = await page.screenshot(self.tmp / f"{name}.png")
        assert path.stat().st_size > 1000
        if self.extra is not None:
            self.extra.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, self.extra / path.name)
        return path


@pytest.fixture
def shots(tmp_path: Path) -> Shots:
    return Shots(tmp_path / "screenshots")


def standin_decoder() -> TokenDecoder:
    """The stand-in engine's vocabulary: its ids are the text's bytes, and the template's two markers keep
    the real ids (tests/support/standin_tokens.py); the long session uses the real Qwen vocabulary, the default."""
    markers = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
    return TokenDecoder(lambda i: chr(i) if i < 128 else markers.get(i), "stand-in bytes")


@contextmanager
def running_ui(kafka: KafkaSettings, decoder: TokenDecoder) -> Iterator[tuple[str, RunView]]:
    """The UI reading this test's topics (as `rollwire ui` does), and its view."""
    view = RunView()
    with serve(create_ui(view, decoder, kafka)) as url:
        yield url, view


@pytest.fixture
def standin_ui(kafka: KafkaSettings) -> Iterator[tuple[str, RunView]]:
    with running_ui(kafka, standin_decoder()) as ui:
        yield ui


@pytest.fixture
def qwen_ui(kafka: KafkaSettings) -> Iterator[tuple[str, RunView]]:
    with running_ui(kafka, decoder_from_env()) as ui:
        yield ui


async def wait_view(check: Any, timeout_s: float = 120) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "the UI's view did not get there in time"
        await asyncio.sleep(0.2)


async def stages(producer: EventProducer, session_id: str, *names: SessionStage) -> None:
    for stage in names:
        await producer.send(SessionStageChanged(session_id=session_id, task_id=TASK_ID, stage=stage, node="node-1"))
        await asyncio.sleep(0.05)


async def test_a_real_run_in_the_browser(kafka: KafkaSettings, standin_ui: tuple[str, RunView], shots: Shots,
                                         tmp_path: Path) -> None:
    ui_url, view = standin_ui
    worker = WorkerProcess(kafka, tmp_path / "worker", extra_env={"ROLLWIRE_PROCESSORS_GRACE_S": "1"})
    worker.start()
    engine = create_standin(StandinConfig(latency_ms=1, reply_tokens=12, token_api=True))
    try:
        with serve(engine) as engine_url, serve(create_proxy(proxy_settings(engine_url), kafka)) as proxy_url:
            def new_session(session_id: str, index: int) -> dict:
                answer = httpx.post(f"{proxy_url}/v1/sessions", timeout=30, json={
                    "session_id": session_id, "task_id": TASK_ID, "engine": {"max_tokens": 12}})
                assert answer.status_code == 201, answer.text
                return answer.json()

            request = TaskRequest(task_id=TASK_ID, instruction="make the test pass", num_samples=3,
                                  agent=AgentSpec(harness="qwen-code"))
            async with EventProducer(kafka) as producer:
                await producer.send(TaskAccepted(task_id=TASK_ID, request=request,
                                                 session_ids=["s-main", "s-fail", "s-late"]))
                # s-main: three turns on one branch, then a fork from its first turn, then a sub-agent.
                main = new_session("s-main", 0)
                await stages(producer, "s-main", SessionStage.INIT, SessionStage.READY, SessionStage.RUNNING)
                history = [SYSTEM, {"role": "user", "content": "go"}]
                for turn in range(3):
                    history = [*history, ask(main, history), {"role": "user", "content": f"next {turn}"}]
                ask(main, [*history[:3], {"role": "user", "content": "a different path"}])
                ask(main, [{"role": "system", "content": "You are a file search specialist."},
                           {"role": "user", "content": "find the test"}])
                await stages(producer, "s-main", SessionStage.POST_RUN)
                # s-fail: one call, then it ends in error.
                failing = new_session("s-fail", 1)
                await stages(producer, "s-fail", SessionStage.INIT, SessionStage.RUNNING)
                ask(failing, [SYSTEM, {"role": "user", "content": "go"}])
                for session_id, status, key in (("s-main", "completed", main["api_key"]),
                                                ("s-fail", "error", failing["api_key"])):
                    answer = httpx.post(f"{proxy_url}/v1/sessions/{session_id}/end", timeout=30,
                                        headers={"authorization": f"Bearer {key}"}, json={"status": status, "reason": "harness exited 1" if status == "error" else None})
                    assert answer.status_code == 200, answer.text
                await producer.send_many([
                    Evaluation(session_id="s-main", task_id=TASK_ID, evaluator="tests", reward=1.0, passed=True),
                    Evaluation(session_id="s-fail", task_id=TASK_ID, evaluator="tests", reward=0.0, passed=False)])
            built = await read_events(kafka, Topic.TRAJECTORIES, until=2, timeout_s=90)
            trajectories = {t.session_id: t for t in built if isinstance(t, Trajectory)}
            assert set(trajectories) == {"s-main", "s-fail"}, worker.log_tail()
            async with EventProducer(kafka) as producer:
                await producer.send(Group(task_id=TASK_ID, samples=[
                    GroupSample(session_id="s-main", trajectory_id=trajectories["s-main"].event_id, reward=1.0,
                                advantage=0.7071, in_baseline=True),
                    GroupSample(session_id="s-fail", trajectory_id=trajectories["s-fail"].event_id, reward=0.0,
                                advantage=-0.7071, in_baseline=True)],
                    baseline_mean=0.5, baseline_std=0.7071, estimator="grpo"))
    finally:
        worker.stop()
    await wait_view(lambda: all(s in view.sessions and view.sessions[s].trajectory() is not None
                                for s in ("s-main", "s-fail")) and view.tasks.get(TASK_ID) is not None
                    and view.tasks[TASK_ID].group is not None)
    health = httpx.get(f"{ui_url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["caught_up"] is True
    main_trajectory = trajectories["s-main"]
    calls_of_main = len(view.sessions["s-main"].completions)
    assert calls_of_main == 5

    async with Chromium() as browser:
        page = await browser.new_page()
        # The runs page links the run.
        await page.goto(ui_url + "/")
        assert await page.eval(f"!!document.querySelector('a[href=\"/runs/{RUN_ID}\"]')")
        # The run page: its sessions, their timelines, the group and the failure kinds.
        await page.goto(run_url(RUN_ID, base=ui_url))
        listed = await page.eval("[...document.querySelectorAll('tr.session')].map(r => r.dataset.session)")
        assert sorted(listed) == ["s-fail", "s-main"]
        assert await page.eval("document.querySelectorAll('tr.session[data-session=\"s-main\"] .seg').length") == 4
        text = await page.eval("document.getElementById('live').innerText")
        assert "error/-" in text and "0.707" in text and "signal" in text
        await shots.take(page, "run")
        # Live: a session that starts now appears without a reload.
        await page.eval("window.__sameDocument = 42")
        async with EventProducer(kafka) as producer:
            await stages(producer, "s-late", SessionStage.INIT)
        await page.wait_for("!!document.querySelector('tr.session[data-session=\"s-late\"]')", timeout_s=30)
        assert await page.eval("window.__sameDocument") == 42

        # The session page: every call in order, the branch reasons, the builder's tree.
        await page.goto(session_url("s-main", base=ui_url))
        sequences = await page.eval("[...document.querySelectorAll('tr.call')].map(r => Number(r.dataset.sequence))")
        assert sequences == list(range(calls_of_main))
        cells = await page.eval("[...document.querySelectorAll('tr.call')].map(r => r.children[11].innerText)")
        assert cells[0] == "new: first_call" and cells[1] == "#0" and cells[2] == "#1"
        assert cells[3] == "new: fork" and cells[4].startswith("new: ")
        nodes = await page.eval("[...document.querySelectorAll('.tree li.branch')].map(li => li.dataset.trace)")
        assert len(nodes) == len(main_trajectory.traces) == 3
        roles = await page.eval("[...document.querySelectorAll('.tree li.branch > .badge.role')].map(b => b.innerText)")
        assert sorted(roles) == sorted(t.role for t in main_trajectory.traces)
        assert "0.707" in await page.eval("document.querySelector('tr.session').innerText")  # its advantage
        await page.eval("document.getElementById('call-3').open = true")
        await shots.take(page, "session")

        # The trace page: exactly the trained tokens are shaded.
        merged = max(range(len(main_trajectory.traces)), key=lambda i: len(main_trajectory.traces[i].sequences))
        trace = main_trajectory.traces[merged]
        assert len(trace.sequences) == 3
        await page.goto(trace_url("s-main", merged, base=ui_url))
        await page.wait_for(f"window.rollwireTrace && window.rollwireTrace.rendered === {len(trace.token_ids)}")
        shaded = await page.eval("[...document.querySelectorAll('.t.m1')].map(s => Number(s.dataset.i))")
        assert shaded == np.flatnonzero(trace.loss_mask.numpy).tolist()
        assert 0 < len(shaded) < len(trace.token_ids)
        unshaded = await page.eval("getComputedStyle(document.querySelector('.t:not(.m1)')).backgroundColor")
        assert unshaded in ("rgba(0, 0, 0, 0)", "transparent")
        boundaries = await page.eval("document.querySelectorAll('.row.call-start').length")
        assert boundaries == len(trace.sequences)
        # Hover: the token's id and its call.
        first = int(shaded[0])
        box = await page.eval(f"(() => {{ const r = document.querySelector('.t[data-i=\"{first}\"]')"
                              ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        await page.hover(*box)
        tip = await page.wait_for("!document.getElementById('tip').hidden && document.getElementById('tip').textContent")
        assert f"id {int(trace.token_ids.numpy[first])}" in tip and "trained" in tip and "call #" in tip
        await shots.take(page, "trace")


async def test_a_long_session_stays_windowed(kafka: KafkaSettings, qwen_ui: tuple[str, RunView],
                                            shots: Shots) -> None:
    """100 calls, one 200,000-token trace: the page holds only the rows in view, and reaches the end."""
    ui_url, view = qwen_ui
    long = long_session("s-long", calls=100, tokens=200_000, seed=3)
    async with EventProducer(kafka) as producer:
        for event in long.events():
            await producer.send(event)
    await wait_view(lambda: "s-long" in view.sessions and view.sessions["s-long"].trajectory() is not None)
    trace = long.trajectory.traces[0]
    assert len(trace.token_ids) == 200_000

    async with Chromium() as browser:
        page = await browser.new_page()
        await page.goto(session_url("s-long", base=ui_url))
        assert await page.eval("document.querySelectorAll('tr.call').length") == 100
        assert await page.eval("document.querySelectorAll('.tree li.branch').length") == 1
        await shots.take(page, "long-session")

        await page.goto(trace_url("s-long", 0, base=ui_url))
        await page.wait_for("window.rollwireTrace && window.rollwireTrace.rendered > 0")
        boot = json.loads(await page.eval("document.getElementById('trace-boot').textContent"))
        assert boot["layout"]["length"] == 200_000 and boot["layout"]["trainable"] == int(trace.loss_mask.numpy.sum())
        assert await page.eval("window.rollwireTrace.rendered") < 5_000  # windowed, not 200k spans
        await page.eval("(() => { const b = document.getElementById('trace'); b.scrollTop = b.scrollHeight; })()")
        await page.wait_for("!!document.querySelector('.t[data-i=\"199999\"]')")
        shown = await page.eval("[...document.querySelectorAll('.t[data-i]')].map(s => Number(s.dataset.i))")
        assert len(shown) < 5_000
        low, high = min(shown), max(shown)
        assert shown == list(range(low, high + 1))
        shaded = await page.eval("[...document.querySelectorAll('.t.m1')].map(s => Number(s.dataset.i))")
        mask = trace.loss_mask.numpy
        assert shaded == (low + np.flatnonzero(mask[low:high + 1])).tolist()
        assert await page.eval("window.rollwireTrace.chunksLoaded") >= 2  # fetched what scrolled into view
        await shots.take(page, "long-trace-end")
        # A link to a token (the page's "go to" links) brings its row into view and marks it.
        await page.eval("location.hash = '#token-150000'")
        await page.wait_for("!!document.querySelector('.t.target[data-i=\"150000\"]')")
        assert await page.eval("window.rollwireTrace.rendered") < 5_000
