"""The attribution rule (schemas/attribution.py): the harness exit judged from its evidence, and the table
docs/failures.md prints kept the same as the one the code applies."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.attribution import RULES, Cause, FailureKind, judge_exit, table_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "failures.md"


@pytest.mark.parametrize(("exit_code", "stderr", "calls", "timed_out", "cause"), [
    (0, "", 3, False, None),
    (None, "", 2, True, Cause.BUDGET),
    (137, "", 4, False, Cause.SANDBOX_KILLED),  # docker exec's 128 + SIGKILL: the memory limit
    (-9, "", 0, False, Cause.SANDBOX_KILLED),
    (1, "bash: fork: retry: Resource temporarily unavailable", 5, False, Cause.SANDBOX_KILLED),  # pids limit
    (-11, "", 3, False, Cause.HARNESS_CRASHED),
    (127, "sh: 1: qwen: not found", 0, False, Cause.HARNESS_MISSING),
    (1, "Error: Cannot find module '/cache/qwen/dist/cli.js'\n    at Module._resolveFilename", 0, False,
     Cause.HARNESS_CRASHED),
    (1, "Traceback (most recent call last):\nModuleNotFoundError: No module named 'x'", 0, False,
     Cause.HARNESS_CRASHED),
    (1, "I could not fix the bug", 3, False, Cause.AGENT_FAILED),
    (1, "", 0, False, Cause.UNKNOWN),
    (1, "Cannot find module 'x'", None, False, Cause.UNKNOWN),  # the call count unknown: no evidence
    (1, "something", None, False, Cause.UNKNOWN),
])
def test_a_harness_exit_is_judged_by_its_evidence(exit_code: int | None, stderr: str, calls: int | None,
                                                  timed_out: bool, cause: Cause | None) -> None:
    assert judge_exit(exit_code, stderr, calls, timed_out=timed_out) is cause



def test_a_fork_refused_at_the_pids_limit_is_the_sandboxs_whatever_the_harness_says() -> None:
    """The runtime counted a fork refused at its pids limit: the sandbox's, even when the harness's own
    words name no EAGAIN and it had worked with the model."""
    assert judge_exit(1, "Error: something went wrong", 3, timed_out=False, pids_limit_hit=True) is Cause.SANDBOX_KILLED
    assert judge_exit(0, "", 3, timed_out=False, pids_limit_hit=True) is None
    assert judge_exit(1, "Error: something went wrong", 3, timed_out=False) is Cause.AGENT_FAILED

def test_every_cause_has_a_rule_and_only_infrastructure_is_resubmitted() -> None:
    assert set(RULES) == set(Cause)
    assert all(rule.kind is FailureKind.INFRASTRUCTURE for rule in RULES.values() if rule.resubmit)
    assert RULES[Cause.UNKNOWN].kind is FailureKind.UNKNOWN and not RULES[Cause.UNKNOWN].resubmit


def test_the_docs_table_is_the_codes_table() -> None:
    assert table_markdown() in DOCS.read_text()
