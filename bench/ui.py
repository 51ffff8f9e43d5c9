"""The UI in headless Chromium: time to first paint of a 200k-token trace page, and a 100-call session page.

    .venv/bin/python -m bench.ui [--tokens 200000] [--calls 100] [--chromium /usr/bin/chromium]

A session of ``--calls`` calls whose one prefix-merged trace holds ``--tokens`` real Qwen token ids (the
completions written as the proxy writes them, prompt deltas included; the trajectory built by the
project's own builder) is put in the UI's view, the app is served on a loopback socket, and Debian's
``chromium`` loads its pages through the Chrome DevTools Protocol. Side by side in the same run: the
same page for a 2,000-token trace. Prints ``name=value`` lines, the key figure last:
``trace_page_ms`` (navigation start to the first tokens painted, cold: the trace's layout is computed
by that request; goal <= 1000).

This module also holds the small CDP client the UI tests drive Chromium with (:class:`Chromium`): it
speaks the protocol over the ``websockets`` library, so no browser driver is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect

from schemas.completions import (
    AssistantMessage,
    CallTimings,
    ChatMessage,
    Completion,
    Continuation,
    Drift,
    NormalizedRequest,
    Usage,
)
from schemas.envelope import Event
from schemas.sessions import SessionEnded, SessionSpec, SessionStage, SessionStageChanged, SessionStatus
from schemas.trajectories import Trajectory

# -- a Chromium driven over the DevTools protocol ---------------------------------------------------------


class BrowserError(RuntimeError):
    """Chromium could not be started, or a protocol command failed."""


def chromium_path() -> str | None:
    """Debian's ``chromium`` (or ``ROLLWIRE_CHROMIUM``), if installed."""
    configured = os.environ.get("ROLLWIRE_CHROMIUM")
    if configured:
        return configured
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Page:
    """One tab, attached with a flat session: commands, script evaluation, screenshots, mouse."""

    def __init__(self, browser: Chromium, session_id: str) -> None:
        self.browser, self.session_id = browser, session_id

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.send(method, params, session_id=self.session_id)

    async def goto(self, url: str, timeout_s: float = 30) -> None:
        """Navigate and wait for the load event."""
        loaded = self.browser.expect("Page.loadEventFired", self.session_id)
        answer = await self.send("Page.navigate", url=url)
        if answer.get("errorText"):
            raise BrowserError(f"navigating to {url}: {answer['errorText']}")
        await asyncio.wait_for(loaded, timeout_s)

    async def eval(self, expression: str) -> Any:
        """The value of ``expression`` (awaited when it is a promise)."""
        answer = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in answer:
            raise BrowserError(f"{expression!r} threw: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30, poll_s: float = 0.05) -> Any:
        """Poll ``expression`` until it is truthy; its value. BrowserError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression!r} still falsy after {timeout_s} s")
            await asyncio.sleep(poll_s)

    async def screenshot(self, path: Path) -> Path:
        answer = await self.send("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(answer["data"]))
        return path

    async def hover(self, x: float, y: float) -> None:
        await self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)


class Chromium:
    """Headless Chromium with its DevTools endpoint on a free port, a throwaway profile, one window size;
    ``async with Chromium() as browser: page = await browser.new_page()``."""

    def __init__(self, executable: str | None = None, *, width: int = 1400, height: int = 900) -> None:
        found = executable or chromium_path()
        if found is None:
            raise BrowserError("no chromium: install Debian's `chromium` (apt-get install -y chromium) or set "
                               "ROLLWIRE_CHROMIUM")
        self.executable, self.width, self.height = found, width, height
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiters: list[tuple[str, str | None, asyncio.Future[dict[str, Any]]]] = []

    async def __aenter__(self) -> Chromium:
        self._profile = tempfile.TemporaryDirectory(prefix="rollwire-chromium-", ignore_cleanup_errors=True)
        profile = Path(self._profile.name)
        self._process = subprocess.Popen(
            [self.executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
             "--remote-debugging-port=0", f"--user-data-dir={profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True)  # its own process group: its helpers (zygote, renderers) end with it
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if self._process.poll() is not None or time.monotonic() > deadline:
                await self.__aexit__(None, None, None)
                raise BrowserError(f"{self.executable} did not open its DevTools port")
            await asyncio.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        self._socket = await connect(f"ws://127.0.0.1:{port}{path}", max_size=None)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._socket is not None:
            await self._socket.close()
        if self._process is not None:
            try:
                os.killpg(self._process.pid, signal.SIGTERM)  # the group this browser leads, and nothing else
            except ProcessLookupError:
                pass
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        if self._profile is not None:
            self._profile.cleanup()

    async def _read(self) -> None:
        assert self._socket is not None
        async for raw in self._socket:
            message = json.loads(raw)
            if "id" in message:
                future = self._pending.pop(message["id"], None)
                if future is not None and not future.done():
                    if "error" in message:
                        future.set_exception(BrowserError(f"{message['error']}"))
                    else:
                        future.set_result(message.get("result", {}))
                continue
            for waiter in list(self._waiters):
                method, session, future = waiter
                if message.get("method") == method and session in (None, message.get("sessionId")):
                    self._waiters.remove(waiter)
                    if not future.done():
                        future.set_result(message.get("params", {}))

    async def send(self, method: str, params: dict[str, Any] | None = None, *,
                   session_id: str | None = None) -> dict[str, Any]:
        assert self._socket is not None, "use `async with Chromium()`"
        command_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        message: dict[str, Any] = {"id": command_id, "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        await self._socket.send(json.dumps(message))
        return await asyncio.wait_for(future, 60)

    def expect(self, method: str, session_id: str | None = None) -> asyncio.Future[dict[str, Any]]:
        """A future for the next ``method`` event (register it before the command that causes it)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters.append((method, session_id, future))
        return future

    async def new_page(self) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        await page.send("Page.enable")
        await page.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                        deviceScaleFactor=1, mobile=False)
        return page


# -- a long session, as the proxy and the trajectory worker would have written it -------------------------

@dataclass
class LongSession:
    """A session's events in log order (spec, stages, completions as written, end, trajectory)."""

    spec: SessionSpec
    completions: list[Completion]
    """As written (prompt deltas and keyframes)."""
    trajectory: Trajectory
    lifecycle: list[Event] = field(default_factory=list)

    def events(self) -> Iterator[Event]:
        yield self.spec
        yield from self.lifecycle[:-1]
        yield from self.completions
        yield self.lifecycle[-1]
        yield self.trajectory


def long_session(session_id: str, *, calls: int = 100, tokens: int = 200_000, seed: int = 0,
                 task_id: str | None = None) -> LongSession:
    """``calls`` exactly continued calls of one branch whose merged trace is ``tokens`` long: each adds tool
    output (context) and a sampled turn, real Qwen ids cut from Python's standard library."""
    from bench.workloads import TokenSource, sampled_logprobs
    from processors.builders import build_trajectory
    from processors.builders.common import SessionFacts
    from schemas.prompt_chain import write_session

    rng = np.random.default_rng(seed)
    source = TokenSource(limit_chars=min(2_000_000, max(200_000, tokens * 5)))
    per_call = max(8, tokens // calls)
    system_n = max(4, per_call // 2)
    sampled_n = max(2, per_call // 3)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    system = source.take(rng, system_n)
    messages = [ChatMessage(role="system", content=source.text(system)),
                ChatMessage(role="user", content="fix the failing test")]
    prompt = system
    fulls: list[Completion] = []
    for sequence in range(calls):
        last = sequence == calls - 1
        used = len(prompt)
        n_sampled = max(1, tokens - used) if last else sampled_n
        sampled = source.take(rng, n_sampled)
        if len(sampled) < n_sampled:
            sampled = np.resize(sampled, n_sampled)
        at = start + timedelta(seconds=2 * sequence)
        reply = source.text(sampled)
        fulls.append(Completion(
            session_id=session_id, task_id=task_id, sequence=sequence, api="openai.chat",
            requested_model="qwen", served_model="rollwire-tiny", policy_version="1",
            request=NormalizedRequest(messages=list(messages)), status="ok",
            prompt_token_ids=prompt.astype(np.int32), token_ids=sampled.astype(np.int32),
            logprobs=sampled_logprobs(rng, len(sampled)), finish_reason="stop" if last else "tool_calls",
            message=AssistantMessage(content=reply), occurred_at=at,
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(sampled)),
            timings=CallTimings(received_at=at, total_ms=float(200 + rng.integers(0, 800)), ttft_ms=40.0),
            continuation=Continuation(mode="exact" if sequence else "rendered", branch="b0",
                                      parent_sequence=sequence - 1 if sequence else None,
                                      opened=None if sequence else "first_call",
                                      prefix_tokens=len(prompt) if sequence else 0,
                                      drift=Drift(differs=False, rendered_prompt_tokens=len(prompt)) if sequence else None)))
        if last:
            break
        tool = source.take(rng, max(1, per_call - sampled_n))
        messages = [*messages, ChatMessage(role="assistant", content=reply),
                    ChatMessage(role="tool", content=source.text(tool), tool_call_id=f"call{sequence}")]
        prompt = np.concatenate([prompt, sampled, tool]).astype(np.int32)
    end_at = start + timedelta(seconds=2 * calls + 1)
    lifecycle: list[Event] = [
        SessionStageChanged(session_id=session_id, task_id=task_id, stage=SessionStage.INIT, occurred_at=start),
        SessionStageChanged(session_id=session_id, task_id=task_id, stage=SessionStage.RUNNING,
                            occurred_at=start + timedelta(seconds=0.5)),
        SessionEnded(session_id=session_id, task_id=task_id, status=SessionStatus.COMPLETED, occurred_at=end_at)]
    trajectory = build_trajectory("prefix_merging", fulls, SessionFacts(
        session_id=session_id, task_id=task_id, policy_version="1", status=SessionStatus.COMPLETED,
        ended_at=end_at))
    spec = SessionSpec(session_id=session_id, task_id=task_id, origin="adhoc" if task_id is None else "rollout")
    return LongSession(spec, write_session(fulls), trajectory, lifecycle)


# -- the benchmark ----------------------------------------------------------------------------------------

async def _trace_page_ms(page: Page, url: str) -> dict[str, float]:
    await page.goto("about:blank")
    await page.goto(url, timeout_s=120)
    painted = await page.wait_for("window.rollwireTrace && window.rollwireTrace.firstPaintMs", timeout_s=120)
    spans = await page.eval("document.querySelectorAll('.t[data-i]').length")
    return {"first_tokens_ms": float(painted), "spans": float(spans)}


async def _scroll_to_end_ms(page: Page, length: int) -> float:
    started = await page.eval("(() => { const b = document.getElementById('trace'); window.__t0 = performance.now();"
                              " b.scrollTop = b.scrollHeight; return window.__t0; })()")
    await page.wait_for(f"document.querySelector('.t[data-i=\"{length - 1}\"]') !== null", timeout_s=60, poll_s=0.01)
    ended = await page.eval("performance.now()")
    return float(ended) - float(started)


async def run_bench(tokens: int, calls: int, executable: str | None) -> list[tuple[str, float]]:
    from bench.serving import serve
    from sinks.ui.app import create_app
    from sinks.ui.tokens import decoder_from_env
    from sinks.ui.view import RunView

    built_at = time.perf_counter()
    view = RunView()
    long = long_session("bench-long", calls=calls, tokens=tokens, seed=1)
    short = long_session("bench-short", calls=10, tokens=2_000, seed=2)
    for session in (long, short):
        for event in session.events():
            view.apply(event, len(event.model_dump_json()))
    setup_s = time.perf_counter() - built_at
    figures: list[tuple[str, float]] = [("trace_tokens", float(len(long.trajectory.traces[0].token_ids))),
                                        ("session_calls", float(len(long.completions))),
                                        ("setup_s", round(setup_s, 2))]
    with serve(create_app(view, decoder_from_env())) as url:
        async with Chromium(executable) as browser:
            page = await browser.new_page()
            await page.goto(f"{url}/sessions/bench-short/traces/0")  # warm the browser and the decoder
            short_cold = await _trace_page_ms(page, f"{url}/sessions/bench-short/traces/0")
            cold = await _trace_page_ms(page, f"{url}/sessions/bench-long/traces/0")
            warm = await _trace_page_ms(page, f"{url}/sessions/bench-long/traces/0")
            scroll_ms = await _scroll_to_end_ms(page, len(long.trajectory.traces[0].token_ids))
            await page.goto("about:blank")
            session_at = time.perf_counter()
            await page.goto(f"{url}/sessions/bench-long", timeout_s=120)
            session_ms = (time.perf_counter() - session_at) * 1000
            rows = await page.eval("document.querySelectorAll('tr.call').length")
    figures += [("session_page_load_ms", round(session_ms, 1)), ("session_page_call_rows", float(rows)),
                ("trace_2k_page_ms", round(short_cold["first_tokens_ms"], 1)),
                ("trace_page_warm_ms", round(warm["first_tokens_ms"], 1)),
                ("trace_page_dom_token_spans", cold["spans"]),
                ("scroll_to_end_ms", round(scroll_ms, 1)),
                ("ratio_200k_to_2k", round(cold["first_tokens_ms"] / max(1e-3, short_cold["first_tokens_ms"]), 2)),
                ("trace_page_ms", round(cold["first_tokens_ms"], 1))]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--chromium", default=None)
    args = parser.parse_args()
    for name, value in asyncio.run(run_bench(args.tokens, args.calls, args.chromium)):
        print(f"{name}={value:g}")


if __name__ == "__main__":
    main()
