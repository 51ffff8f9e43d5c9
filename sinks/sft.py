"""The SFT store: accepted trajectories as a chat-messages dataset (JSONL and Parquet) with acceptance stats.

A session's trajectory is *accepted* for an evaluator when that evaluator's reward is at or above the
threshold. Each trace (with at least one trained token) of an accepted trajectory whose branch role is
among ``SftCriteria.roles`` (``ROLLWIRE_SFT_ROLES``, ``--roles``; main and sub_agent by default, see
sinks/roles.py) becomes one row; a trace left out for its role is counted in ``rows_skipped_by_role``:

- ``messages``: the conversation in the chat-messages form `datasets` and TRL's SFTTrainer read
  (``role``, ``content`` as text, ``tool_calls`` in the OpenAI shape with ``arguments`` as the sampled
  JSON text, ``tool_call_id``, ``name``, ``reasoning_content``). Decision: the text comes from the
  completion events, not from decoding token ids: the trace's last completion (highest sequence) carries
  the normalized request (every earlier turn as the harness sent it back, tool results included) and the
  parsed reply, so the row has the real roles, tool calls and tool results with no tokenizer at hand.
  Text content parts are joined; image parts are left out of ``content``.
- ``tools``: the tools offered, as a JSON string (JSON Schemas differ per tool, and one Arrow column
  cannot hold differently shaped structs; ``json.loads`` gives TRL's list back).
- ``token_ids`` and ``loss_mask``: the trace exactly as trained on (never re-tokenized).
- ``id`` (``<trajectory event id>:<trace id>``), ``trajectory_id``, ``session_id``, ``task_id``,
  ``trace_id``, ``evaluator``, ``reward``, ``builder``, ``policy_version``.

Files in the output directory: ``sft.jsonl`` (appended), ``sft.parquet`` (rewritten from the JSONL at
each flush, atomically), ``decisions.jsonl`` (one line per session and evaluator: attempted, accepted,
why not) and ``stats.json`` (accepted / attempted overall, by evaluator and by task). Idempotent on replay:
rows are keyed by ``id`` and decisions by session and evaluator; keys already in the files are skipped,
so replaying the log any number of times into the same directory adds nothing twice.

An attempt is a session with an ``ok`` evaluation from a matching evaluator. Evaluations that errored
are counted apart (``evaluation_errors``), not as attempts. A session evaluated but without a trajectory
is decided (not accepted, "no trajectory") only at :meth:`SftStore.finish`, when a replay has read the
whole log; an accepted trace whose last completion is not in the log is counted in
``rows_without_messages`` and not written.

Completions may be prompt deltas (schema version 2): each is resolved through
:class:`schemas.prompt_chain.PromptChains` as it is read (partitions in order, parents first), so a
conversation always holds the whole request. One whose parent cannot be had (retention, a damaged
record, a replay started mid-log) is counted in ``completions_missing_parent`` and keeps no conversation:
a row that needs it stays in ``rows_without_messages``, never written from half a conversation. The store
reads beside the worker and dead-letters nothing.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.completions import Completion, ToolCall
from schemas.envelope import Event
from schemas.evaluations import Evaluation
from schemas.prompt_chain import DEFAULT_CACHE_BYTES, MissingPromptParent, PromptChains
from schemas.trajectories import Trace, Trajectory
from sinks.roles import sft_roles_from_env

logger = logging.getLogger(__name__)

ROWS_FILE = "sft.jsonl"
PARQUET_FILE = "sft.parquet"
DECISIONS_FILE = "decisions.jsonl"
STATS_FILE = "stats.json"
DEFAULT_MESSAGE_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SftCriteria:
    """Which evaluations accept a trajectory: the evaluator's name (None: any) and the minimum reward; and
    which of an accepted trajectory's traces become rows: those whose branch role is in ``roles``
    (default: ``ROLLWIRE_SFT_ROLES``, else main and sub_agent)."""

    min_reward: float = 1.0
    evaluator: str | None = None
    roles: frozenset[str] = field(default_factory=sft_roles_from_env)

    def matches(self, evaluation: Evaluation) -> bool:
        return self.evaluator is None or evaluation.evaluator == self.evaluator

    def keeps(self, trace: Trace) -> bool:
        """Whether ``trace``'s branch role is one this dataset takes."""
        return trace.role in self.roles


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type == "text")


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _message(role: str, content: Any, *, tool_calls: list[ToolCall] | None = None,
             tool_call_id: str | None = None, name: str | None = None,
             reasoning: str | None = None) -> dict[str, Any]:
    # Every message has every key, so that Arrow sees one struct type for the whole column.
    return {"role": role, "content": _text(content), "tool_calls": _tool_calls(tool_calls or []),
            "tool_call_id": tool_call_id, "name": name, "reasoning_content": reasoning}


def conversation(completion: Completion) -> tuple[list[dict[str, Any]], str]:
    """The chat messages of a completion (its request, then its reply) and its tools as JSON text."""
    messages = [_message(m.role, m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id,
                         name=m.name, reasoning=m.reasoning) for m in completion.request.messages]
    reply = completion.message
    if reply is not None:
        messages.append(_message("assistant", reply.content, tool_calls=reply.tool_calls,
                                 reasoning=reply.reasoning))
    tools = [t.model_dump(mode="json", exclude_none=True) for t in completion.request.tools]
    return messages, json.dumps(tools, separators=(",", ":"))


def _last_completion_id(trace: Trace) -> str | None:
    if not trace.completion_ids:
        return None
    if len(trace.sequences) == len(trace.completion_ids):
        return max(zip(trace.sequences, trace.completion_ids))[1]
    return trace.completion_ids[-1]


class _Conversations:
    """Conversations of recent completions by session and event id, at most ``max_bytes`` of JSON, oldest
    dropped. By session too: an event id is the writer's to choose, and a completion of another session
    that reuses one must never fill this session's row."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[tuple[str, str], tuple[list[dict[str, Any]], str, int]] = OrderedDict()

    def add(self, completion: Completion) -> None:
        key = (completion.session_id, completion.event_id)
        if key in self._items or completion.status != "ok":
            return
        messages, tools = conversation(completion)
        size = len(json.dumps(messages)) + len(tools)
        self._items[key] = (messages, tools, size)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._items) > 1:
            _, (_, _, old) = self._items.popitem(last=False)
            self.bytes -= old

    def get(self, session_id: str, completion_id: str) -> tuple[list[dict[str, Any]], str] | None:
        found = self._items.get((session_id, completion_id))
        return None if found is None else (found[0], found[1])


class SftStore:
    """Joins completions, trajectories and evaluations into the SFT files of one output directory."""

    def __init__(self, out_dir: Path, criteria: SftCriteria,
                 message_cache_bytes: int = DEFAULT_MESSAGE_CACHE_BYTES,
                 prompt_cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.criteria = criteria
        self._conversations = _Conversations(message_cache_bytes)
        self._chains = PromptChains(prompt_cache_bytes)
        self.completions_missing_parent: dict[str, str] = {}  # completion id -> why its prompt is unresolved
        self._trajectories: dict[str, list[Trajectory]] = defaultdict(list)
        self._evaluations: dict[str, list[Evaluation]] = defaultdict(list)
        self._row_ids = self._read_keys(ROWS_FILE, lambda d: d["id"])
        self._decisions: dict[tuple[str, str], dict[str, Any]] = {
            (d["session_id"], d["evaluator"]): d for d in self._read_lines(DECISIONS_FILE)}
        self.rows_written = 0
        self.rows_without_messages: dict[str, str] = {}  # row id -> session id, retried as events come
        self.rows_skipped_for_role: dict[str, str] = {}  # row id -> the trace's role, not among criteria.roles
        self.evaluation_errors = 0
        self._rows_out = (self.out_dir / ROWS_FILE).open("a", encoding="utf-8")
        self._decisions_out = (self.out_dir / DECISIONS_FILE).open("a", encoding="utf-8")

    def _read_lines(self, name: str) -> list[dict[str, Any]]:
        path = self.out_dir / name
        if not path.exists():
            return []
        lines = []
        with path.open(encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    try:
                        lines.append(json.loads(line))
                    except json.JSONDecodeError:
                        # A line cut short by a crash mid-write: its row is written again on replay.
                        logger.warning("%s: skipping a partial line", path)
        return lines

    def _read_keys(self, name: str, key: Any) -> set[str]:
        return {key(d) for d in self._read_lines(name)}

    # -- intake -----------------------------------------------------------------------------------------
    def take(self, event: Event) -> None:
        """Take one event of `completions`, `trajectories` or `evaluations` (others are ignored)."""
        if isinstance(event, Completion):
            try:
                full = self._chains.resolve(event)
            except MissingPromptParent as exc:
                self.completions_missing_parent[event.event_id] = exc.reason
                logger.warning("completion %s (session %s, sequence %d) has no conversation: %s", event.event_id,
                               event.session_id, event.sequence, exc.reason)
                return
            self._conversations.add(full)
            return
        if isinstance(event, Trajectory):
            self._trajectories[event.session_id].append(event)
            self._decide(event.session_id)
        elif isinstance(event, Evaluation):
            if not self.criteria.matches(event):
                return
            if event.status != "ok" or event.reward is None:
                self.evaluation_errors += 1
                return
            self._evaluations[event.session_id].append(event)
            self._decide(event.session_id)

    def _decide(self, session_id: str) -> None:
        trajectories = self._trajectories.get(session_id)
        if not trajectories:
            return
        for evaluation in self._evaluations.get(session_id, ()):
            accepted = evaluation.reward is not None and evaluation.reward >= self.criteria.min_reward
            self._record_decision(evaluation, trajectories[0], accepted, None if accepted else "reward below threshold")
            if accepted:
                for trajectory in trajectories:
                    self._write_rows(trajectory, evaluation)
        # Rows of accepted traces whose completion was not seen yet are retried as other events come.

    def _record_decision(self, evaluation: Evaluation, trajectory: Trajectory | None, accepted: bool,
                         reason: str | None) -> None:
        key = (evaluation.session_id, evaluation.evaluator)
        if key in self._decisions:
            return
        decision = {"session_id": evaluation.session_id,
                    "task_id": evaluation.task_id or (trajectory.task_id if trajectory else None),
                    "evaluator": evaluation.evaluator, "reward": evaluation.reward, "accepted": accepted,
                    "reason": reason, "trajectory_id": trajectory.event_id if trajectory else None,
                    "evaluation_id": evaluation.event_id}
        self._decisions[key] = decision
        self._decisions_out.write(json.dumps(decision) + "\n")

    def _write_rows(self, trajectory: Trajectory, evaluation: Evaluation) -> None:
        for trace in trajectory.traces:
            row_id = f"{trajectory.event_id}:{trace.trace_id}"
            if row_id in self._row_ids or not trace.loss_mask.numpy.any():
                continue
            if not self.criteria.keeps(trace):
                self.rows_skipped_for_role[row_id] = trace.role
                continue
            completion_id = _last_completion_id(trace)
            found = self._conversations.get(trajectory.session_id, completion_id) if completion_id else None
            if found is None:
                self.rows_without_messages[row_id] = trajectory.session_id
                continue
            messages, tools = found
            row = {"id": row_id, "trajectory_id": trajectory.event_id, "session_id": trajectory.session_id,
                   "task_id": trajectory.task_id or evaluation.task_id, "trace_id": trace.trace_id,
                   "evaluator": evaluation.evaluator, "reward": evaluation.reward, "builder": trajectory.builder,
                   "policy_version": trajectory.policy_version, "messages": messages, "tools": tools,
                   "token_ids": trace.token_ids.tolist(), "loss_mask": trace.loss_mask.tolist()}
            self._rows_out.write(json.dumps(row, separators=(",", ":")) + "\n")
            self._row_ids.add(row_id)
            self.rows_without_messages.pop(row_id, None)
            self.rows_written += 1

    def retry_pending(self) -> None:
        """Try again the rows of accepted sessions that lacked their completion."""
        for session_id in set(self.rows_without_messages.values()):
            self._decide(session_id)

    # -- output -----------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """At the end of a replay: decide sessions evaluated but never given a trajectory, flush, and
        return the statistics."""
        self.retry_pending()
        for session_id, evaluations in self._evaluations.items():
            if not self._trajectories.get(session_id):
                for evaluation in evaluations:
                    self._record_decision(evaluation, None, False, "no trajectory")
        return self.flush()

    def flush(self) -> dict[str, Any]:
        """Sync the JSONL files, rewrite the Parquet file and the statistics; returns the statistics."""
        for handle in (self._rows_out, self._decisions_out):
            handle.flush()
            os.fsync(handle.fileno())
        self._write_parquet()
        stats = self.stats()
        tmp = self.out_dir / (STATS_FILE + ".tmp")
        tmp.write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(self.out_dir / STATS_FILE)
        return stats

    def _write_parquet(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self._read_lines(ROWS_FILE)
        seen: set[str] = set()
        unique = [r for r in rows if not (r["id"] in seen or seen.add(r["id"]))]  # type: ignore[func-returns-value]
        tmp = self.out_dir / (PARQUET_FILE + ".tmp")
        pq.write_table(pa.Table.from_pylist(unique), tmp)
        tmp.replace(self.out_dir / PARQUET_FILE)

    def stats(self) -> dict[str, Any]:
        """Accepted / attempted overall, by evaluator and by task, from the decisions on file."""
        def rate(accepted: int, attempted: int) -> float | None:
            return round(accepted / attempted, 4) if attempted else None

        total = [0, 0]
        by_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        by_evaluator: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for decision in self._decisions.values():
            for counts in (total, by_task[decision["task_id"] or "-"], by_evaluator[decision["evaluator"]]):
                counts[0] += 1
                counts[1] += int(decision["accepted"])
        skipped_by_role: dict[str, int] = defaultdict(int)
        for role in self.rows_skipped_for_role.values():
            skipped_by_role[role] += 1
        return {
            "evaluator": self.criteria.evaluator, "min_reward": self.criteria.min_reward,
            "roles": sorted(self.criteria.roles),
            "attempted": total[0], "accepted": total[1], "acceptance_rate": rate(total[1], total[0]),
            "rows": len(self._row_ids), "rows_without_messages": len(self.rows_without_messages),
            "completions_missing_parent": len(self.completions_missing_parent),
            "rows_skipped_by_role": dict(sorted(skipped_by_role.items())),
            "evaluation_errors": self.evaluation_errors,
            "by_evaluator": {k: {"attempted": a, "accepted": c, "acceptance_rate": rate(c, a)}
                             for k, (a, c) in sorted(by_evaluator.items())},
            "by_task": {k: {"attempted": a, "accepted": c, "acceptance_rate": rate(c, a)}
                        for k, (a, c) in sorted(by_task.items())},
        }

    def close(self) -> None:
        for handle in (self._rows_out, self._decisions_out):
            if not handle.closed:
                handle.close()


async def run_sft_store(settings: Any, out_dir: Path, criteria: SftCriteria, *, from_beginning: bool = True,
                        follow: bool = False, flush_every_s: float = 30.0) -> dict[str, Any]:
    """Read completions, trajectories and evaluations into an :class:`SftStore` (no consumer group: the
    store's position is its output directory, which makes replays idempotent). Without ``follow``, stops
    once it has caught up with the log and returns the statistics."""
    import time

    from schemas.topics import Topic
    from schemas.transport.consumer import EventConsumer

    store = SftStore(out_dir, criteria)
    topics = [Topic.COMPLETIONS, Topic.TRAJECTORIES, Topic.EVALUATIONS]
    try:
        async with EventConsumer(settings, topics, group_id=None, service="sft-store",
                                 from_beginning=from_beginning, dead_letters=False) as consumer:
            last_flush = time.monotonic()
            while True:
                received = await consumer.getmany(timeout_ms=500)
                for item in received:
                    store.take(item.event)
                if received:
                    store.retry_pending()
                if follow:
                    if time.monotonic() - last_flush >= flush_every_s:
                        store.flush()
                        last_flush = time.monotonic()
                elif not received and await consumer.lag() == 0:
                    return store.finish()
    finally:
        store.close()
