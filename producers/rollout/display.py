"""What the main job shows: live progress (sessions by stage, completions recorded), the summary table,
rewards per session, the groups with their advantages, and the acceptance rate of the SFT store.

Everything here renders :class:`~schemas.rollouts.TaskStatus` views (as the rollout server serves them),
:class:`~schemas.groups.Group` events and the SFT store's statistics with ``rich``; nothing reads Kafka or
HTTP, so the same tables can be built from hand-written events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import mean
from typing import Any

from rich.console import Group as Lines
from rich.table import Table
from rich.text import Text

from schemas.groups import Group
from schemas.rollouts import SessionStatusView, TaskState, TaskStatus
from schemas.sessions import FailureKind, SessionStage, SessionStatus
from schemas.ui_links import run_url, session_url

STAGES: tuple[str, ...] = tuple(stage.value for stage in SessionStage)
TIMED_STAGES: tuple[str, ...] = ("init", "ready", "running", "post_run", "teardown")


def _sessions(statuses: Sequence[TaskStatus]) -> list[SessionStatusView]:
    return [s for status in statuses for s in status.sessions]


def stage_counts(statuses: Sequence[TaskStatus]) -> dict[str, int]:
    """Sessions per stage (running sessions) and per end status (ended ones), over all tasks."""
    counts = {stage: 0 for stage in STAGES}
    for s in _sessions(statuses):
        key = s.status.value if s.status is not None else s.stage.value
        counts[key] = counts.get(key, 0) + 1
    return counts


def progress_line(statuses: Sequence[TaskStatus], elapsed_s: float) -> str:
    """One line: elapsed time, sessions per stage, completions, trajectories, tasks done."""
    counts = stage_counts(statuses)
    sessions = _sessions(statuses)
    parts = [f"{k}={v}" for k, v in counts.items() if v]
    done = sum(1 for t in statuses if t.state == TaskState.DONE)
    return (f"[{elapsed_s:6.0f}s] sessions {len(sessions)}: {' '.join(parts) or '-'} | completions="
            f"{sum(s.completions for s in sessions)} trajectories={sum(1 for s in sessions if s.trajectory_id)} "
            f"| tasks done {done}/{len(statuses)}")


def progress_table(statuses: Sequence[TaskStatus], elapsed_s: float) -> Table:
    """The live view: one row per task with its sessions by stage, completions and state."""
    table = Table(title=f"rollout — {elapsed_s:.0f} s", title_justify="left", expand=False)
    table.add_column("task")
    table.add_column("state")
    for stage in STAGES:
        table.add_column(stage.replace("_", "-"), justify="right")
    table.add_column("ended", justify="right")
    table.add_column("completions", justify="right")
    table.add_column("trajectories", justify="right")
    for status in statuses:
        running = [s for s in status.sessions if not s.ended]
        by_stage = {stage: sum(1 for s in running if s.stage.value == stage) for stage in STAGES}
        table.add_row(status.task_id, status.state.value, *(str(by_stage[s] or "") for s in STAGES),
                      f"{sum(1 for s in status.sessions if s.ended)}/{status.num_samples}",
                      str(sum(s.completions for s in status.sessions)),
                      str(sum(1 for s in status.sessions if s.trajectory_id)))
    return table


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mean_stage_time(sessions: Sequence[SessionStatusView], stage: str) -> float | None:
    values = [s.timings[stage] for s in sessions if stage in s.timings]
    return mean(values) if values else None


def _verdict_name(statuses: Sequence[TaskStatus]) -> str:
    """What a pass is called: ``resolved`` for SWE-bench-style tasks (the ``swebench`` evaluator)."""
    return "resolved" if any(s.evaluator == "swebench" for s in statuses) else "passed"


def summary_table(statuses: Sequence[TaskStatus]) -> Table:
    """The final table: per task and in total, sessions by outcome, completions, trajectories, rewards
    (where an evaluator ran) and mean seconds per stage."""
    table = Table(title="rollout summary", title_justify="left")
    table.add_column("task", no_wrap=True)
    for name in ("sessions", "completed", "failed\npolicy", "failed\ninfra", "failed\nunknown", "retries",
                 "not\nended", "completions",
                 "trajectories", "traces per\nsession", "reward\n(mean, n)", _verdict_name(statuses)):
        table.add_column(name, justify="right")
    for stage in TIMED_STAGES:
        table.add_column(f"{stage.replace('_', '-')}\ns (mean)", justify="right")
    rows = [(status.task_id, status.sessions, status.evaluator) for status in statuses]
    if len(statuses) > 1:
        rows.append(("total", _sessions(statuses), next((s.evaluator for s in statuses if s.evaluator), None)))
    for index, (name, sessions, evaluator) in enumerate(rows):
        if index == len(statuses) and index:
            table.add_section()
        rewards = [s.reward for s in sessions if s.reward is not None]
        verdicts = [e.passed for s in sessions for e in s.evaluations
                    if e.evaluator == evaluator and e.passed is not None]
        table.add_row(
            name, str(len(sessions)),
            str(sum(1 for s in sessions if s.status == SessionStatus.COMPLETED)),
            str(sum(1 for s in sessions if s.ended and s.status != SessionStatus.COMPLETED
                    and s.failure not in (FailureKind.INFRASTRUCTURE, FailureKind.UNKNOWN))),
            str(sum(1 for s in sessions if s.failure == FailureKind.INFRASTRUCTURE)),
            str(sum(1 for s in sessions if s.failure == FailureKind.UNKNOWN)),
            str(sum(len(s.retries) for s in sessions)),
            str(sum(1 for s in sessions if not s.ended)),
            str(sum(s.completions for s in sessions)),
            str(sum(1 for s in sessions if s.trajectory_id)),
            _traces_per_session(sessions),
            (_fmt(mean(rewards)) + f" ({len(rewards)})") if rewards else ("-" if evaluator else "none"),
            f"{sum(verdicts)}/{len(verdicts)}" if verdicts else "-",
            *(_fmt(_mean_stage_time(sessions, stage), 1) for stage in TIMED_STAGES),
        )
    return table


def failures_table(statuses: Sequence[TaskStatus]) -> Table | None:
    """Sessions that did not complete, with why (the ones a resubmission replaced too, marked
    ``replaced by``); None when every session completed at its first attempt."""
    rows: list[tuple[str, str, str, str, str, str]] = []
    for s in _sessions(statuses):
        chain = [r.session_id for r in s.retries] + [s.session_id]
        for earlier, replaced_by in zip(s.retries, chain[1:]):
            rows.append((earlier.session_id, "error", "infrastructure", earlier.cause.value if earlier.cause else "-",
                         f"replaced by {replaced_by}", (earlier.reason or "-")[:140]))
        if s.status != SessionStatus.COMPLETED:
            rows.append((s.session_id, s.status.value if s.status else f"not ended ({s.stage.value})",
                         s.failure.value if s.failure else "-", s.cause.value if s.cause else "-",
                         "-" if s.exit_code is None else f"exit {s.exit_code}", (s.reason or "-")[:140]))
    if not rows:
        return None
    table = Table(title="sessions that did not complete", title_justify="left")
    for name in ("session", "status", "failure", "cause", "exit / retry", "reason"):
        table.add_column(name)
    for row in rows:
        table.add_row(*row)
    return table


def _advantage(groups: Mapping[str, Group], task_id: str, session_id: str) -> str:
    group = groups.get(task_id)
    if group is None:
        return "no group"
    sample = next((x for x in group.samples if x.session_id == session_id), None)
    if sample is None or sample.advantage is None:
        return "none (infra)"  # flagged for resubmission, not trained on
    if not sample.in_baseline:
        return f"{sample.advantage:+.3f} (failed)"  # kept out of the baseline
    return f"{sample.advantage:+.3f}"


def _traces_per_session(sessions: Sequence[SessionStatusView]) -> str:
    """Mean agent traces (main + sub-agent branches) per built session, side branches counted apart."""
    built = [s for s in sessions if s.trajectory_id and not s.partial]
    if not built:
        return "-"
    side = sum(s.traces_by_role.get("side", 0) for s in built)
    agent = sum((s.traces or 0) for s in built) - side
    return _fmt(agent / len(built)) + (f" +{side} side" if side else "")


def _traces(session: SessionStatusView) -> str:
    """``1 trace``, or with its side branches named: ``1 trace + 1 side`` (side calls: titles, routers)."""
    roles = session.traces_by_role
    side = roles.get("side", 0)
    agent = (session.traces or 0) - side
    text = f"{agent} trace" + ("" if agent == 1 else "s")
    if roles.get("sub_agent"):
        text += f" ({roles['sub_agent']} sub-agent)"
    return text + (f" + {side} side" if side else "")


def sessions_table(statuses: Sequence[TaskStatus], groups: Mapping[str, Group]) -> Table:
    """One row per session: how it ended, its calls and trajectory, its reward, whether it passed (for the
    ``swebench`` evaluator: whether the instance is resolved) and its GRPO advantage."""
    table = Table(title="rewards per session", title_justify="left")
    for name in ("session", "status", "retries", "completions", "trajectory", "reward", _verdict_name(statuses),
                 "advantage"):
        table.add_column(name, justify="left" if name in ("session", "status", "trajectory") else "right",
                         no_wrap=name == "session")
    for status in statuses:
        for s in status.sessions:
            verdict = next((e for e in s.evaluations if e.evaluator == status.evaluator), None)
            trajectory = "-" if not s.trajectory_id else ("partial" if s.partial else _traces(s))
            ended = s.status.value if s.status else f"not ended ({s.stage.value})"
            if s.failure is not None:
                ended += f" ({s.failure.value}{', ' + s.cause.value if s.cause else ''})"
            table.add_row(s.session_id, ended, str(len(s.retries)), str(s.completions), trajectory, _fmt(s.reward),
                          "-" if verdict is None or verdict.passed is None else ("yes" if verdict.passed else "no"),
                          _advantage(groups, status.task_id, s.session_id))
    return table


def groups_table(statuses: Sequence[TaskStatus], groups: Mapping[str, Group]) -> Table:
    """One row per task: its group on `groups` (rewards, baseline, advantages), or why there is none yet."""
    table = Table(title="groups emitted", title_justify="left")
    for name in ("task", "samples", "rewards", "mean", "std", "advantages", "complete", "signal"):
        table.add_column(name, justify="left" if name in ("task", "rewards", "advantages") else "right",
                         no_wrap=name == "task")
    for status in statuses:
        group = groups.get(status.task_id)
        if group is None:
            missing = sum(1 for s in status.sessions if not s.trajectory_id)
            why = (f"not yet: {missing} sessions have no trajectory (it is emitted at the task's deadline)"
                   if missing else "not yet")
            table.add_row(status.task_id, str(status.num_samples), why, "", "", "", "", "")
            continue
        rewards = " ".join(_fmt(x.reward) for x in group.samples)
        advantages = " ".join("-" if x.advantage is None else f"{x.advantage:+.2f}" for x in group.samples)
        signal = "none (equal rewards)" if group.no_signal else "yes"
        if group.insufficient:
            signal = f"kept out: {group.usable} of {len(group.samples)} usable"
        table.add_row(group.task_id, str(len(group.samples)), rewards, _fmt(group.baseline_mean),
                      _fmt(group.baseline_std), advantages, "yes" if group.complete else "no", signal)
    return table


def acceptance_line(stats: Mapping[str, Any]) -> Text:
    """accepted / attempted at the SFT store's threshold (and the rows written)."""
    evaluator = stats.get("evaluator") or "any evaluator"
    attempted, accepted = stats.get("attempted", 0), stats.get("accepted", 0)
    rate = stats.get("acceptance_rate")
    rate_text = "-" if rate is None else f"{100 * rate:.1f}%"
    rows = stats.get("rows", 0)
    note = "" if rows else " (no accepted trajectory: the SFT files have no rows)"
    return Text(f"acceptance ({evaluator}, reward >= {stats.get('min_reward')}): {accepted}/{attempted} "
                f"accepted = {rate_text}; SFT rows {rows}{note}")


def outputs(topics: dict[str, str], server_url: str, task_ids: Sequence[str], files: Sequence[str]) -> Lines:
    """Where the outputs are: topics, the server's result URLs, files that sinks wrote."""
    lines = [Text("outputs", style="bold")]
    for label, name in topics.items():
        lines.append(Text(f"  topic {label:<15} {name}"))
    for task_id in task_ids:
        lines.append(Text(f"  result {server_url}/v1/tasks/{task_id}/result"))
    for path in files:
        lines.append(Text(f"  file {path}"))
    if not files:
        lines.append(Text("  files: none written during this run"))
    return Lines(*lines)


def pages(ui_url: str, run_id: str, statuses: Sequence[TaskStatus]) -> Lines:
    """Where to look at the run in the web page (``rollwire ui``): the run, then each session."""
    lines = [Text("pages", style="bold"), Text(f"  run      {run_url(run_id, ui_url)}")]
    for status in statuses:
        for session in status.sessions:
            lines.append(Text(f"  session  {session_url(session.session_id, ui_url)}"))
    return Lines(*lines)
