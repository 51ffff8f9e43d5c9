"""Whose failure a failed session is: the rule, as one table, and the evidence it is decided on.

A GRPO group that counts a crashed CLI as the policy's failure trains on noise, and a trainer that
resubmits only infrastructure failures never resubmits a sample the machine lost. So every place where a
session can end (the gateway node's pipeline, its runtimes and adapters, the proxy check around a run, an
evaluator) names a :class:`Cause`, and the cause alone decides the failure kind and whether the rollout
server resubmits the sample (:data:`RULES`; docs/failures.md prints the same table). What was seen goes
into the session's end event as :class:`Evidence`: the exit code, the signal, the first lines of stderr,
the model calls the proxy recorded.

The harness's own exit is judged by :func:`judge_exit`, in this order:

1. exit 0: no failure;
2. killed by the session's budget: the policy's (``budget``);
3. killed by SIGKILL or SIGTERM the node did not send (the OOM killer, the container's memory limit), or
   failing to fork at the pids limit (said on stderr, or counted by the runtime: ``pids_limit_hit``): the
   sandbox's (``sandbox_killed``); another signal (SIGSEGV, SIGABRT, …): the harness's runtime crashed
   (``harness_crashed``);
4. the binary could not be run (exit 126/127, ``exec format error``, ``not found``): ``harness_missing``;
5. no model call was made and stderr shows an error of the harness's own runtime (``Cannot find module``,
   an uncaught exception with its stack, a Python traceback): ``harness_crashed``;
6. at least one model call was made: the agent ran and failed, the policy's (``agent_failed``);
7. otherwise (non-zero exit, no model call, nothing recognised, or the call count unknown): ``unknown``.

An ``unknown`` sample is kept out of the baseline and out of the trainer, never in as a policy failure,
and is not resubmitted: resubmitting only the samples that failed for reasons nobody knows could resample
the policy's own failures away and bias the group.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pydantic import Field

from schemas.envelope import Model

STDERR_HEAD_LINES = 12
STDERR_LINE_CHARS = 300


class FailureKind(str, enum.Enum):
    """Whose fault a failed session is: the policy's (kept as a negative sample), the infrastructure's
    (kept out of training and baselines, resubmitted where its rule says), or unknown (the evidence does
    not tell: kept out of training and baselines, never counted as the policy's). Re-exported by
    schemas.sessions, where the session events use it."""

    POLICY = "policy"
    INFRASTRUCTURE = "infrastructure"
    UNKNOWN = "unknown"


class Cause(str, enum.Enum):
    """Why a session failed, one row of :data:`RULES` each."""

    HARNESS_INSTALL = "harness_install"
    HARNESS_MISSING = "harness_missing"
    HARNESS_CRASHED = "harness_crashed"
    RUNTIME_INIT = "runtime_init"
    SANDBOX_KILLED = "sandbox_killed"
    PROXY_UNREACHABLE = "proxy_unreachable"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    KAFKA = "kafka"
    NODE_LOST = "node_lost"
    NO_RUN_SLOT = "no_run_slot"
    AGENT_SPEC = "agent_spec"
    EVALUATOR_CRASHED = "evaluator_crashed"
    AGENT_FAILED = "agent_failed"
    BUDGET = "budget"
    BAD_PATCH = "bad_patch"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Rule:
    """One row: the cause, whose failure it is, whether the sample is resubmitted, what shows it."""

    cause: Cause
    kind: FailureKind
    resubmit: bool
    evidence: str


RULES: dict[Cause, Rule] = {rule.cause: rule for rule in (
    Rule(Cause.HARNESS_INSTALL, FailureKind.INFRASTRUCTURE, True,
         "npm failed, or the installed CLI does not run `--version`"),
    Rule(Cause.HARNESS_MISSING, FailureKind.INFRASTRUCTURE, True,
         "the binary is not there or cannot be executed (exit 126/127, ENOENT, exec format error)"),
    Rule(Cause.HARNESS_CRASHED, FailureKind.INFRASTRUCTURE, True,
         "non-zero exit before its first model call, with an error of its own runtime on stderr "
         "(module not found, uncaught exception with a stack, Python traceback)"),
    Rule(Cause.RUNTIME_INIT, FailureKind.INFRASTRUCTURE, True,
         "the workspace, the container or a set-up command failed"),
    Rule(Cause.SANDBOX_KILLED, FailureKind.INFRASTRUCTURE, True,
         "killed by a signal the node did not send (OOM killer, memory limit: SIGKILL, exit 137; a "
         "container's OOM kill is recorded as `oom_killed`) or could not fork at the pids limit (EAGAIN on "
         "stderr, or the runtime's `pids_limit_hit`)"),
    Rule(Cause.PROXY_UNREACHABLE, FailureKind.INFRASTRUCTURE, True,
         "the proxy did not answer, or did not know the session, before or after the run"),
    Rule(Cause.ENGINE_UNAVAILABLE, FailureKind.INFRASTRUCTURE, True,
         "the engine's /health did not answer 200 when the session started, or after a run without model calls"),
    Rule(Cause.KAFKA, FailureKind.INFRASTRUCTURE, True, "the broker refused the session's `running` event"),
    Rule(Cause.NODE_LOST, FailureKind.INFRASTRUCTURE, True,
         "the gateway node that ran it stopped; another node ended it"),
    Rule(Cause.NO_RUN_SLOT, FailureKind.INFRASTRUCTURE, True, "no run slot came free within the session's budget"),
    Rule(Cause.AGENT_SPEC, FailureKind.INFRASTRUCTURE, False,
         "the adapter refused the agent spec (bad settings): the same spec would fail again"),
    Rule(Cause.EVALUATOR_CRASHED, FailureKind.INFRASTRUCTURE, False,
         "the evaluator could not score the session (evaluation status `error`); the session itself is kept"),
    Rule(Cause.AGENT_FAILED, FailureKind.POLICY, False,
         "non-zero exit after at least one model call"),
    Rule(Cause.BUDGET, FailureKind.POLICY, False, "the harness ran past the session's budget"),
    Rule(Cause.BAD_PATCH, FailureKind.POLICY, False, "its patch cannot be taken (git failed, over the size limit)"),
    Rule(Cause.UNKNOWN, FailureKind.UNKNOWN, False,
         "non-zero exit, no model call and no recognised error, or the call count could not be read"),
)}


def kind_of(cause: Cause) -> FailureKind:
    return RULES[cause].kind


def resubmitted(cause: Cause | None, kind: FailureKind | None) -> bool:
    """Whether a session that ended with this cause is resubmitted (an infrastructure failure whose row
    says so; an end without a cause but marked infrastructure counts as one)."""
    if cause is not None:
        return RULES[cause].resubmit
    return kind is FailureKind.INFRASTRUCTURE


class Evidence(Model):
    """What was seen when a session failed: the facts the cause was decided on."""

    exit_code: int | None = None
    signal: int | None = Field(default=None, description="The signal that ended the harness, when one did.")
    timed_out: bool = False
    stderr_head: list[str] = Field(default_factory=list, description=(
        f"The first {STDERR_HEAD_LINES} non-empty lines of the harness's stderr (each cut at "
        f"{STDERR_LINE_CHARS} characters)."))
    model_calls: int | None = Field(default=None, description=(
        "Model calls the proxy recorded for the session; None when it could not be asked."))
    oom_killed: bool | None = Field(default=None, description=(
        "The sandbox's memory limit killed a process while the harness ran (a container's OOM kill, as its "
        "engine reports it); None where the runtime cannot tell."))
    pids_limit_hit: bool | None = Field(default=None, description=(
        "A fork was refused at the sandbox's pids limit while the harness ran; None where the runtime cannot "
        "tell."))
    stage: str | None = Field(default=None, description="The pipeline stage the session failed in.")
    detail: str | None = None


def stderr_head(stderr: str) -> list[str]:
    """The first non-empty lines of ``stderr``, cut short (what a reader needs to see why)."""
    lines = [line.rstrip()[:STDERR_LINE_CHARS] for line in stderr.splitlines() if line.strip()]
    return lines[:STDERR_HEAD_LINES]


_MISSING = re.compile(r"exec format error|cannot execute|: not found|No such file or directory|ENOENT|"
                      r"command not found|Permission denied", re.IGNORECASE)
_RUNTIME_ERROR = re.compile(
    r"Cannot find module|MODULE_NOT_FOUND|ERR_MODULE_NOT_FOUND|ERR_REQUIRE_ESM|SyntaxError:|ReferenceError:|"
    r"TypeError:|node:internal/|FATAL ERROR:|Traceback \(most recent call last\)|ModuleNotFoundError|"
    r"ImportError|error while loading shared libraries|Segmentation fault|core dumped|Illegal instruction")
_NO_FORK = re.compile(r"Resource temporarily unavailable|EAGAIN|fork: retry|can't fork|Cannot fork|"
                      r"pthread_create|uv_thread_create|spawn .* EAGAIN", re.IGNORECASE)
_KILL_SIGNALS = frozenset({9, 15})
"""SIGKILL, SIGTERM: sent by the kernel's OOM killer or whoever else killed it (the node's own kills at
the budget or a cancel are known to it and judged before); any other signal is the harness crashing."""


def exit_signal(exit_code: int | None) -> int | None:
    """The signal an exit code stands for: negative (Python's for a killed child) or 128+N (a shell's,
    ``docker exec``'s); None for a plain exit."""
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code < 160:
        return exit_code - 128
    return None


def judge_exit(exit_code: int | None, stderr: str, model_calls: int | None, *, timed_out: bool,
               pids_limit_hit: bool = False) -> Cause | None:
    """The cause of a harness's exit by the order in the module docstring; None when it did not fail.
    ``pids_limit_hit``: the runtime counted a fork refused at its pids limit while the harness ran."""
    if timed_out:
        return Cause.BUDGET
    if exit_code == 0:
        return None
    signal = exit_signal(exit_code)
    if signal in _KILL_SIGNALS or pids_limit_hit or _NO_FORK.search(stderr):
        return Cause.SANDBOX_KILLED
    if signal is not None:
        return Cause.HARNESS_CRASHED
    if exit_code in (126, 127):
        return Cause.HARNESS_MISSING
    if model_calls == 0:
        if _RUNTIME_ERROR.search(stderr):
            return Cause.HARNESS_CRASHED
        if _MISSING.search(stderr):
            return Cause.HARNESS_MISSING
        return Cause.UNKNOWN
    if model_calls is None:
        return Cause.UNKNOWN
    return Cause.AGENT_FAILED


def table_markdown() -> str:
    """:data:`RULES` as the Markdown table docs/failures.md carries (a test keeps the two the same)."""
    rows = ["| cause | whose | resubmitted | evidence |", "|---|---|---|---|"]
    for rule in RULES.values():
        rows.append(f"| `{rule.cause.value}` | {rule.kind.value} | {'yes' if rule.resubmit else 'no'} | "
                    f"{rule.evidence} |")
    return "\n".join(rows)
