"""Rows and trainer tokens: per_request versus prefix_merging on the same sessions.

Two kinds of sessions go through both builders:

(a) recorded sessions: completion events (``Completion`` JSON, one per file or one per line of a
    ``.jsonl``) found under ``tests/fixtures/sessions/``, grouped by session id: the real CLIs' scripted
    sessions on the real vLLM engine, written there by ``record_sessions.py`` as ``<cli>-<n>.jsonl``
    (figures per CLI, named after the file, then over all of them), or call :func:`compare` directly.
    Their turns were forced by token ids, the template's own, so each linear session merges into one
    row (five calls each: ``recorded_rows_ratio=5.00``);
(b) generated long sessions: a main agent of ``--turns`` turns with ``--tool-tokens``-token tool outputs,
    two side calls (title generation, memory extraction), a sub-agent started from the main agent's
    context (4 turns) and a history rewrite (old tool outputs elided) ten turns before the end.

Trainer tokens are the sum over rows of the row's sequence length (what a trainer feeds forward). The
builders' time per completion is measured on events already decoded (the builder's own cost), on the long
sessions and on shorter ones (8 turns, ~3k-token completions: ``short_completion_tokens`` says).

    python -m bench.merge [--sessions N] [--turns T] [--tool-tokens K]

Prints ``name=value`` lines: ``recorded_<cli>_…`` per CLI, ``recorded_…`` over the recorded sessions
(``recorded_rows_ratio``), then the generated sessions' figures, the key figure last: ``rows_ratio``
(per_request rows / prefix_merging rows on the generated sessions).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from bench.workloads import sampled_logprobs
from processors.builders import SessionFacts, build_trajectory
from schemas.completions import ChatMessage, Completion, NormalizedRequest
from schemas.prompt_chain import resolve_session

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "sessions"
VOCAB = 151_643  # Qwen's
EOT = 151_645  # <|im_end|>


@dataclass
class Figures:
    """What both builders made of a set of sessions."""

    sessions: int = 0
    completions: int = 0
    per_request_rows: int = 0
    prefix_merging_rows: int = 0
    per_request_trainer_tokens: int = 0
    prefix_merging_trainer_tokens: int = 0
    branches: int = 0
    per_request_seconds: float = 0.0
    prefix_merging_seconds: float = 0.0
    problems: int = 0

    def lines(self, prefix: str = "") -> list[str]:
        per_completion = max(self.completions, 1)
        return [
            f"{prefix}sessions={self.sessions}",
            f"{prefix}completions={self.completions}",
            f"{prefix}per_request_rows={self.per_request_rows}",
            f"{prefix}prefix_merging_rows={self.prefix_merging_rows}",
            f"{prefix}prefix_merging_branches={self.branches}",
            f"{prefix}prefix_merging_problems={self.problems}",
            f"{prefix}per_request_trainer_tokens={self.per_request_trainer_tokens}",
            f"{prefix}prefix_merging_trainer_tokens={self.prefix_merging_trainer_tokens}",
            f"{prefix}trainer_tokens_ratio="
            f"{_ratio(self.per_request_trainer_tokens, self.prefix_merging_trainer_tokens)}",
            f"{prefix}per_request_us_per_completion={1e6 * self.per_request_seconds / per_completion:.1f}",
            f"{prefix}prefix_merging_us_per_completion={1e6 * self.prefix_merging_seconds / per_completion:.1f}",
            f"{prefix}rows_ratio={_ratio(self.per_request_rows, self.prefix_merging_rows)}",
        ]


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "nan"


def compare(sessions: Iterable[Sequence[Completion]]) -> Figures:
    """Run both builders over each session's completion events (the hook for recorded sessions)."""
    figures = Figures()
    for events in sessions:
        if not events:
            continue
        facts = SessionFacts(session_id=events[0].session_id)
        figures.sessions += 1
        figures.completions += len(events)
        start = time.perf_counter()
        per_request = build_trajectory("per_request", events, facts)
        middle = time.perf_counter()
        merged = build_trajectory("prefix_merging", events, facts)
        figures.per_request_seconds += middle - start
        figures.prefix_merging_seconds += time.perf_counter() - middle
        figures.per_request_rows += len(per_request.traces)
        figures.prefix_merging_rows += len(merged.traces)
        figures.per_request_trainer_tokens += sum(len(t.token_ids) for t in per_request.traces)
        figures.prefix_merging_trainer_tokens += sum(len(t.token_ids) for t in merged.traces)
        figures.branches += merged.stats.branches
        figures.problems += len(merged.stats.problems)
    return figures


def recorded_sessions(root: Path = FIXTURES) -> list[list[Completion]]:
    """Completion events stored under ``root`` (JSON or JSONL files), grouped by session id."""
    return [events for sessions in recorded_by_cli(root).values() for events in sessions]


def cli_of(path: Path) -> str:
    """The CLI a recorded file is named after: ``codex-2.jsonl`` -> ``codex`` (else the file's stem)."""
    head, _, tail = path.stem.rpartition("-")
    return head if head and tail.isdigit() else path.stem


def recorded_by_cli(root: Path = FIXTURES) -> dict[str, list[list[Completion]]]:
    """Completion events stored under ``root``, grouped by session id, the sessions by the CLI their file
    is named after (:func:`cli_of`; a session spread over files goes with its first file's CLI)."""
    by_session: dict[str, list[Completion]] = defaultdict(list)
    cli: dict[str, str] = {}
    for path in sorted(root.rglob("*.json*")) if root.is_dir() else []:
        text = path.read_text(encoding="utf-8", errors="replace")
        documents = text.splitlines() if path.suffix == ".jsonl" else [text]
        for document in documents:
            if '"completion"' not in document:
                continue
            try:
                event = Completion.model_validate_json(document)
            except ValidationError:
                continue  # a request-body fixture or another event type, not a completion event
            by_session[event.session_id].append(event)
            cli.setdefault(event.session_id, cli_of(path))
    grouped: dict[str, list[list[Completion]]] = defaultdict(list)
    for session_id in sorted(by_session, key=lambda s: (cli[s], s)):
        # Recorded as written (v1 keyframes, or v2 prompt deltas): resolved to full prompts; a call whose
        # parent is not in the files is left out.
        grouped[cli[session_id]].append(resolve_session(by_session[session_id]).resolved)
    return dict(grouped)


class _SessionWriter:
    """Completion events for one generated session, with random token ids and realistic logprobs."""

    def __init__(self, rng: np.random.Generator, session_id: str) -> None:
        self.rng, self.session_id, self.events = rng, session_id, []

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n, dtype=np.int32)

    def call(self, prompt: np.ndarray, sampled_n: int) -> np.ndarray:
        """Record one call; return its full sequence (the sampled ids end with the end-of-turn token)."""
        sampled = np.append(self.tokens(sampled_n - 1), np.int32(EOT)).astype(np.int32)
        self.events.append(Completion(
            session_id=self.session_id, sequence=len(self.events), api="openai.chat",
            request=NormalizedRequest(messages=[ChatMessage(role="user", content="(elided in benchmark)")]),
            prompt_token_ids=prompt, token_ids=sampled, logprobs=sampled_logprobs(self.rng, sampled_n),
            finish_reason="tool_calls"))
        return np.concatenate([prompt, sampled])

    def reply_len(self) -> int:
        return int(np.clip(self.rng.lognormal(np.log(250), 0.9), 8, 4000))

    def tool_output(self, mean: int) -> np.ndarray:
        return self.tokens(int(self.rng.integers(mean * 3 // 4, mean * 5 // 4 + 1)))


def generate_session(rng: np.random.Generator, session_id: str, *, turns: int = 50,
                     tool_tokens: int = 8000, system_tokens: int = 3000) -> list[Completion]:
    """One long agent session with side calls, a sub-agent and a history rewrite (see the module doc)."""
    writer = _SessionWriter(rng, session_id)
    system, task = writer.tokens(system_tokens), writer.tokens(200)
    context = np.concatenate([system, task])
    checkpoints = []
    rewrite_at = max(turns - 10, 2)  # needs two checkpoints: the rewrite keeps an early one, not the tip
    for turn in range(turns):
        if turn == rewrite_at:  # the harness elides old tool outputs: the prompt keeps only an early prefix
            summary = writer.tokens(min(1500, tool_tokens))
            context = np.concatenate([checkpoints[min(3, len(checkpoints) - 2)], summary])
        context = writer.call(context, writer.reply_len())
        checkpoints.append(context)
        if turn in (1, turns // 2):  # side calls: title generation, memory extraction
            writer.call(np.concatenate([writer.tokens(400), task]), 24)
        if turn == turns // 3:  # a sub-agent started from the main agent's context
            sub = np.concatenate([context, writer.tokens(300)])
            for _ in range(4):
                sub = np.concatenate([writer.call(sub, writer.reply_len()), writer.tool_output(tool_tokens // 4)])
            context = np.concatenate([context, writer.tokens(min(500, tool_tokens))])  # the sub-agent's report
        else:
            context = np.concatenate([context, writer.tool_output(tool_tokens)])
    return writer.events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--tool-tokens", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    recorded = recorded_by_cli()
    if recorded:
        for cli, sessions in recorded.items():
            name = cli.replace("-", "_")
            print(*(line for line in compare(sessions).lines(f"recorded_{name}_") if "_us_" not in line), sep="\n")
        print(*compare([s for sessions in recorded.values() for s in sessions]).lines("recorded_"), sep="\n")
    else:
        where = FIXTURES.relative_to(Path.cwd()) if FIXTURES.is_relative_to(Path.cwd()) else FIXTURES
        print(f"recorded_sessions=0  # no Completion events under {where}; record them with "
              "tests/fixtures/sessions/record_sessions.py or pass sessions to compare()")

    rng = np.random.default_rng(args.seed)
    # Builder cost on shorter sessions, nearer the pipeline benchmark's 2k-token completions.
    short = compare([generate_session(rng, f"short-{i}", turns=8, tool_tokens=150, system_tokens=1000)
                     for i in range(50)])
    print(f"short_completion_tokens={short.per_request_trainer_tokens // max(short.completions, 1)}")
    print(*(line for line in short.lines("short_") if "_us_" in line), sep="\n")

    generated = [generate_session(rng, f"gen-{i}", turns=args.turns, tool_tokens=args.tool_tokens)
                 for i in range(args.sessions)]
    print(f"turns={args.turns}", f"tool_tokens={args.tool_tokens}", sep="\n")
    print(*compare(generated).lines(), sep="\n")


if __name__ == "__main__":
    main()
