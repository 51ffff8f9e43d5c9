"""The UI's view and page data without a browser or a broker: the byte bound, runs, which call each trace
token came from, token chunks, and the links the terminal prints."""

from __future__ import annotations

import numpy as np
import pytest

from bench.ui import long_session
from schemas.sessions import SessionSpec
from schemas.tasks import AgentSpec, TaskAccepted, TaskRequest
from schemas import ui_links as links
from sinks.ui import pages
from sinks.ui.tokens import TokenDecoder
from sinks.ui.view import NO_RUN, RunView, run_of

ASCII = TokenDecoder(lambda i: chr(i) if i < 128 else None, "ascii")


def test_run_ids_come_from_the_main_jobs_task_ids() -> None:
    assert run_of("fix-r2611240900ab") == "2611240900ab"
    assert run_of("fix") == NO_RUN and run_of(None) == NO_RUN and run_of("x-r12") == NO_RUN


def test_the_view_drops_the_least_recently_updated_sessions_past_its_budget() -> None:
    view = RunView(max_bytes=1024 * 1024)
    for i in range(5):
        view.apply(SessionSpec(session_id=f"s{i}"), 300 * 1024)
    assert list(view.sessions) == ["s2", "s3", "s4"] and view.evicted_sessions == 2
    view.apply(SessionSpec(session_id="s2", task_id="t"), 1)  # s2 touched: s3 is now the stalest
    view.apply(SessionSpec(session_id="s5"), 300 * 1024)
    assert list(view.sessions) == ["s4", "s2", "s5"] and view.evicted_sessions == 3
    assert view.bytes == sum(s.bytes for s in view.sessions.values()) <= view.max_bytes
    with pytest.raises(ValueError, match="at least 1 MiB"):
        RunView(max_bytes=10)


def test_a_task_lists_its_sessions_under_its_run() -> None:
    view = RunView()
    request = TaskRequest(task_id="t-r2611240900ab", instruction="go", agent=AgentSpec(harness="pi"))
    view.apply(TaskAccepted(task_id=request.task_id, request=request, session_ids=["a", "b"]), 100)
    view.apply(SessionSpec(session_id="b", task_id=request.task_id, sample_index=1), 100)
    view.apply(SessionSpec(session_id="a", task_id=request.task_id, sample_index=0), 100)
    view.apply(SessionSpec(session_id="loose"), 100)
    (run, tasks), = [(r, t) for r, t in view.runs().items() if r != NO_RUN]
    assert run == "2611240900ab" and [s.session_id for s in view.sessions_of(tasks[0])] == ["a", "b"]
    assert [s.session_id for s in view.loose_sessions()] == ["loose"]


def test_each_trace_token_belongs_to_the_call_that_brought_it() -> None:
    session = long_session("s", calls=5, tokens=600, seed=0)
    trace = session.trajectory.traces[0]
    view = RunView()
    for event in session.events():
        view.apply(event, 10)
    calls = {c.sequence: c for c in view.sessions["s"].completions.values()}
    spans = pages.call_spans(trace, calls)
    assert [s.sequence for s in spans] == [0, 1, 2, 3, 4]
    assert spans[0].start == 0 and spans[-1].end == len(trace.token_ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    mask = trace.loss_mask.numpy
    for span in spans:  # every call's sampled turn ends its span
        assert mask[span.end - 1] == 1
    chunk = pages.token_chunk(trace, spans, ASCII, 100, 50)
    assert chunk["start"] == 100 and chunk["end"] == 150 and len(chunk["ids"]) == 50
    assert chunk["mask"] == "".join(str(int(m)) for m in mask[100:150])
    assert chunk["call"] == [int(np.searchsorted([s.end for s in spans], p, side="right")) for p in range(100, 150)]
    assert all((lp is None) == (m == 0) for lp, m in zip(chunk["logprobs"], mask[100:150]))
    layout = pages.trace_layout(trace, calls, ASCII)
    assert layout.rows[0] == 0 and all(b - a <= pages.ROW_TOKENS for a, b in zip(layout.rows, layout.rows[1:]))
    assert {s.start for s in spans} <= set(layout.rows)  # each call starts a row


def test_links_name_the_pages() -> None:
    assert links.session_url("a/b", base="http://h:1/") == "http://h:1/sessions/a%2Fb"
    assert links.trace_url("s", 2, base="http://h:1") == "http://h:1/sessions/s/traces/2"
    assert links.run_url("2611240900ab", base="") == "/runs/2611240900ab"


def test_the_session_page_names_each_calls_engine() -> None:
    session = long_session("s", calls=3, tokens=200, seed=1)
    view = RunView()
    for event in session.events():
        if getattr(event, "event_type", None) == "completion":
            event = event.model_copy(update={"engine": f"engine-{event.sequence % 2}",
                                             "engine_attempts": 2 if event.sequence == 2 else 1})
        view.apply(event, 10)
    rows = pages.call_rows(view.sessions["s"], session.trajectory)
    assert [(r.engine, r.engine_attempts) for r in rows] == [("engine-0", 1), ("engine-1", 1), ("engine-0", 2)]
