"""The UI's web app: server-rendered pages (Jinja2) over the view, a few JSON endpoints, and one SSE stream.

Pages: ``/`` (runs), ``/runs/{run_id}`` (tasks, groups, sessions with timelines, failure kinds),
``/sessions/{session_id}`` (calls, messages, branch tree), ``/sessions/{session_id}/traces/{n}`` (tokens).
JSON: ``/health``, ``/api/state``, ``/api/sessions/{id}/calls/{sequence}`` (the call resolved: whole prompt and reply),
``/api/sessions/{id}/traces/{n}/tokens?start=&count=`` (a chunk of the trace). ``/api/updates`` is an
event stream of the view's version; live pages reload their content when it moves. Read-only: there is
no route that writes anything.

The pages' script and style are files of this package (``static/``), served from here: no CDN, no build.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape

from schemas.completions import Completion
from schemas.prompt_chain import resolve_session
from schemas.trajectories import Trace, Trajectory
from schemas.transport.settings import KafkaSettings
from schemas import ui_links as links
from sinks.ui import pages
from sinks.ui.reader import follow
from sinks.ui.tokens import TokenDecoder
from sinks.ui.view import NO_RUN, RunView, SessionState, run_of

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_LAYOUTS_KEPT = 8


class _Layouts:
    """The last few traces' layouts (a 200k-token trace's row starts cost a pass over its ids)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, int], pages.TraceLayout] = OrderedDict()

    def get(self, trajectory: Trajectory, index: int, session: SessionState,
            decoder: TokenDecoder) -> pages.TraceLayout:
        key = (trajectory.event_id, index)
        layout = self._kept.get(key)
        if layout is None:
            calls = {c.sequence: c for c in session.completions.values()}
            layout = self._kept[key] = pages.trace_layout(trajectory.traces[index], calls, decoder)
            while len(self._kept) > _LAYOUTS_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        return layout


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(_HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.globals.update(session_url=lambda s: links.session_url(s, base=""),
                       run_url=lambda r: links.run_url(r, base=""),
                       trace_url=lambda s, i: links.trace_url(s, i, base=""),
                       message_text=pages.message_text, NO_RUN=NO_RUN)
    env.filters["ms"] = lambda v: "" if v is None else f"{v:,.0f}"
    env.filters["num"] = lambda v, digits=3: "" if v is None else f"{v:.{digits}f}"
    env.filters["short"] = lambda v, n=10: "" if v is None else (v if len(v) <= n else v[:n] + "…")
    return env


def create_app(view: RunView, decoder: TokenDecoder, settings: KafkaSettings | None = None, *,
               poll_s: float = 0.5) -> FastAPI:
    """The app over ``view``. With ``settings`` it reads the log into the view itself while it runs
    (:func:`sinks.ui.reader.follow` from the beginning); without, the caller fills the view."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings is None:
            yield
            return
        stop = asyncio.Event()
        reading = asyncio.create_task(follow(view, settings, stop=stop), name="ui-reader")
        try:
            yield
        finally:
            stop.set()
            try:
                await asyncio.wait_for(reading, 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                reading.cancel()
            except Exception:  # the reader's own failure was logged by the task; the app is going down anyway
                logger.exception("ui reader failed")

    app = FastAPI(title="rollwire ui", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.mount("/static", StaticFiles(directory=_HERE / "static"), name="static")
    env = _environment()
    layouts = _Layouts()

    def render(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        context.setdefault("live", False)
        html = env.get_template(name).render(view=view, version=view.version, **context)
        return HTMLResponse(html, status_code=status_code)

    def session_or_404(session_id: str) -> SessionState:
        session = view.sessions.get(session_id)
        if session is None:
            raise HTTPException(404, f"session {session_id!r} is not in the view: not on the log (yet), or "
                                f"dropped to keep the view within {view.max_bytes} bytes "
                                f"({view.evicted_sessions} sessions dropped)")
        return session

    def trace_or_404(session: SessionState, index: int) -> tuple[Trajectory, Trace]:
        trajectory = session.trajectory()
        if trajectory is None or not 0 <= index < len(trajectory.traces):
            raise HTTPException(404, f"session {session.session_id!r} has no trace {index} "
                                f"({len(trajectory.traces) if trajectory else 0} traces built)")
        return trajectory, trajectory.traces[index]

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> HTMLResponse | JSONResponse:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
        return render("error.html", status_code=exc.status_code, message=exc.detail)

    @app.get("/", response_class=HTMLResponse)
    async def home() -> HTMLResponse:
        runs = []
        for run_id, tasks in view.runs().items():
            sessions = [s for task in tasks for s in view.sessions_of(task)]
            runs.append({"run_id": run_id, "tasks": len(tasks), "sessions": len(sessions),
                         "statuses": pages.status_counts(sessions)})
        loose = pages.session_rows(view.loose_sessions()[:200])
        return render("home.html", live=True, runs=runs, loose=loose)

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    async def run_page(run_id: str) -> HTMLResponse:
        tasks = view.runs().get(run_id)
        if tasks is None:
            raise HTTPException(404, f"no task of run {run_id!r} is in the view")
        sessions = [s for task in tasks for s in view.sessions_of(task)]
        return render("run.html", live=True, run_id=run_id, blocks=pages.task_blocks(view, tasks),
                      statuses=pages.status_counts(sessions), failures=pages.failure_kinds(sessions))

    @app.get("/sessions/{session_id}", response_class=HTMLResponse)
    async def session_page(session_id: str) -> HTMLResponse:
        session = session_or_404(session_id)
        trajectory = session.trajectory()
        calls = pages.call_rows(session, trajectory)
        task = view.tasks.get(session.task_id or "")
        group = task.group if task is not None else None
        samples = {s.session_id: s for s in group.samples} if group is not None else None
        row = pages.session_rows([session], samples)[0]
        return render("session.html", live=True, session=session, row=row, calls=calls, trajectory=trajectory,
                      tree=pages.branch_tree(trajectory, calls), run_id=run_of(session.task_id))

    @app.get("/sessions/{session_id}/traces/{index}", response_class=HTMLResponse)
    async def trace_page(session_id: str, index: int) -> HTMLResponse:
        session = session_or_404(session_id)
        trajectory, trace = trace_or_404(session, index)
        layout = layouts.get(trajectory, index, session, decoder)
        first = pages.token_chunk(trace, layout.calls, decoder, 0, pages.CHUNK_TOKENS)
        boot = json.dumps({"layout": layout.as_json(), "first": first,
                           "tokens_url": f"/api/sessions/{quote(session_id, safe='')}/traces/{index}/tokens"},
                          separators=(",", ":")).replace("</", "<\\/")
        trained = np.flatnonzero(trace.loss_mask.numpy)
        return render("trace.html", session=session, trajectory=trajectory, trace=trace, index=index,
                      layout=layout, boot=boot, decoder=decoder.name,
                      first_trained=int(trained[0]) if len(trained) else None)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """For the stack's launcher: the app answers (``caught_up``: the view holds what the log held)."""
        return {"status": "ok", "caught_up": view.caught_up, "events": view.events}

    @app.get("/api/state")
    async def state() -> dict[str, Any]:
        return {"version": view.version, "events": view.events, "sessions": len(view.sessions),
                "tasks": len(view.tasks), "bytes": view.bytes, "max_bytes": view.max_bytes,
                "evicted_sessions": view.evicted_sessions, "caught_up": view.caught_up}

    @app.get("/api/sessions/{session_id}/calls/{sequence}")
    async def call_json(session_id: str, sequence: int) -> JSONResponse:
        session = session_or_404(session_id)
        chain = resolve_session(session.calls())
        found = [c for c in chain.resolved if c.sequence == sequence]
        if not found:
            broken = [m.reason for m in chain.missing if m.completion.sequence == sequence]
            raise HTTPException(404, broken[0] if broken else f"session {session_id!r} has no call {sequence}")
        return JSONResponse(_call_json(found[-1]))

    @app.get("/api/sessions/{session_id}/traces/{index}/tokens")
    async def tokens(session_id: str, index: int, start: int = Query(0, ge=0),
                     count: int = Query(pages.CHUNK_TOKENS, ge=1, le=8 * pages.CHUNK_TOKENS)) -> JSONResponse:
        session = session_or_404(session_id)
        trajectory, trace = trace_or_404(session, index)
        layout = layouts.get(trajectory, index, session, decoder)
        return JSONResponse(pages.token_chunk(trace, layout.calls, decoder, start, count))

    @app.get("/api/updates")
    async def updates(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            seen, quiet = -1, 0.0
            while not await request.is_disconnected():
                if view.version != seen:
                    seen, quiet = view.version, 0.0
                    yield f"data: {seen}\n\n".encode()
                elif quiet >= 15.0:
                    quiet = 0.0
                    yield b": keep-alive\n\n"
                await asyncio.sleep(poll_s)
                quiet += poll_s
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    return app


def _call_json(call: Completion) -> dict[str, Any]:
    """A resolved call for the page: its whole request as the harness sent it (normalized) and the reply."""
    return {"sequence": call.sequence, "event_id": call.event_id, "api": call.api,
            "messages": [m.model_dump(mode="json", exclude_none=True) for m in call.request.messages],
            "tools": [t.name for t in call.request.tools],
            "sampling": call.request.sampling.model_dump(mode="json", exclude_none=True),
            "reply": call.message.model_dump(mode="json", exclude_none=True) if call.message else None,
            "prompt_tokens": len(call.prompt_token_ids or ()), "finish_reason": call.finish_reason}
