"""The ``swebench`` evaluator: a session's patch graded SWE-bench's way, in a fresh container of the task image.

For every ended session: a new container of ``settings.image`` (else the session's ``runtime.image``),
started through producers.runtimes.docker with no network and the image's own repository as workspace
(``workdir``, default ``/testbed``, at the spec's base commit). In it, in order:

1. the session's patch (``SessionEnded.patch``), by ``git apply --verbose``, else by ``patch --batch
   --fuzz=3 -p1`` (``details.patch_applied_by`` says which);
2. the files ``test_patch`` touches are put back as the base commit has them (a session's edits to those
   tests do not count, as in SWE-bench's harness), then ``test_patch`` by ``git apply``;
3. the tests: ``settings.test_cmd`` (a shell string) if given, else ``python3 -m pytest -rA -p
   no:cacheprovider`` on the files the listed test ids name, with ``settings.timeout_s`` (900).

pytest's ``-rA`` short summary (``PASSED``/``FAILED``/``ERROR``/``SKIPPED``/``XFAIL``/``XPASS`` lines with
node ids) gives each listed test's outcome; a listed test that never appears there is ``missing``. A test
passes when it ``passed`` or ``xfail`` (SWE-bench's rule); anything else, skipped included, does not (SWE-bench
ignores a skipped test: this is stricter). ``resolved`` = every FAIL_TO_PASS and every PASS_TO_PASS test
passes; reward 1.0 if resolved else 0.0, ``passed`` = resolved.

Verdicts that score 0 with ``details.reason``: an empty patch, a patch that applies neither way, a test run
past its timeout (``details.timed_out``), unresolved tests (the failing ones named in
``details.fail_to_pass_failing`` / ``pass_to_pass_failing``). Status 'error' (not the policy's fault): bad
settings, no Docker engine or image, a test patch that does not apply. The container is removed on every
path (the handle's teardown, in ``finally``).

Settings (``EvaluatorSpec.settings``, made by schemas.swebench.to_task_request): ``FAIL_TO_PASS`` and
``PASS_TO_PASS`` (lists, or JSON-encoded lists), ``test_patch``, ``test_cmd``, ``image``, ``workdir``,
``timeout_s`` (900), ``init_timeout_s`` (300: the container's start).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from processors.evaluators.base import EvaluatorConfigError
from processors.evaluators.containers import OUTPUT_TAIL_CHARS, ContainerEvaluator, output_tail
from producers.runtimes.base import RuntimeHandle, RuntimeInitError
from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec
from schemas.swebench import TESTBED, parse_test_ids
from schemas.tasks import RuntimeSpec

DEFAULT_TIMEOUT_S = 900.0
DEFAULT_INIT_TIMEOUT_S = 300.0
PATCH_TIMEOUT_S = 120.0
PATCH_FUZZ = 3
PASSING = frozenset({"passed", "xfail"})
STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_FAILING_FIRST = ("failed", "error")
_SUMMARY_LINE = re.compile(rf"^({'|'.join(STATUSES)}) (.+)$")
_DIFF_GIT = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_EVAL_DIR = "swebench-eval"
_TAIL_MARK = "@@rollwire-output-tail@@"


@dataclass(frozen=True, slots=True)
class GradingPlan:
    """What one grading needs, read from the settings and the session spec."""

    image: str
    workdir: str
    base_commit: str | None
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_patch: str
    test_cmd: str | None
    timeout_s: float
    init_timeout_s: float

    @property
    def listed(self) -> list[str]:
        """Every listed test id once, FAIL_TO_PASS first."""
        return list(dict.fromkeys([*self.fail_to_pass, *self.pass_to_pass]))

    def test_argv(self, log_path: str) -> list[str]:
        """The test command, its output (stdout and stderr) written to ``log_path`` in the container."""
        if self.test_cmd:
            return ["sh", "-c", f"{{ {self.test_cmd}\n}} > {shlex.quote(log_path)} 2>&1"]
        files = listed_test_files(self.listed)
        if not files:
            raise EvaluatorConfigError("no test file in the FAIL_TO_PASS/PASS_TO_PASS ids (pytest node ids "
                                       "'path/to/test_x.py::test_y' expected); give settings.test_cmd")
        pytest = ["python3", "-m", "pytest", "-rA", "-p", "no:cacheprovider", *files]
        return ["sh", "-c", f'"$@" > {shlex.quote(log_path)} 2>&1', "sh", *pytest]


def plan_from(settings: Mapping[str, Any], spec: SessionSpec | None) -> GradingPlan:
    """The grading plan; EvaluatorConfigError says what is missing or malformed."""
    runtime = spec.runtime if spec is not None else None
    image = settings.get("image") or (runtime.image if runtime is not None else None)
    if not isinstance(image, str) or not image:
        raise EvaluatorConfigError("no image: settings.image or the session's runtime.image is needed")
    try:
        fail_to_pass = parse_test_ids(settings.get("FAIL_TO_PASS"))
        pass_to_pass = parse_test_ids(settings.get("PASS_TO_PASS"))
    except ValueError as exc:
        raise EvaluatorConfigError(f"FAIL_TO_PASS/PASS_TO_PASS: {exc}") from None
    if not fail_to_pass and not pass_to_pass:
        raise EvaluatorConfigError("settings.FAIL_TO_PASS and PASS_TO_PASS list no test")
    test_cmd = settings.get("test_cmd")
    if test_cmd is not None and (not isinstance(test_cmd, str) or not test_cmd.strip()):
        raise EvaluatorConfigError(f"settings.test_cmd must be a non-empty shell string, got {test_cmd!r}")
    test_patch = settings.get("test_patch") or ""
    if not isinstance(test_patch, str):
        raise EvaluatorConfigError("settings.test_patch must be a diff (a string)")
    workdir = settings.get("workdir") or (runtime.workdir if runtime is not None else None) or TESTBED
    try:
        timeout_s = float(settings.get("timeout_s", DEFAULT_TIMEOUT_S))
        init_timeout_s = float(settings.get("init_timeout_s", DEFAULT_INIT_TIMEOUT_S))
    except (TypeError, ValueError) as exc:
        raise EvaluatorConfigError(f"timeouts: {exc}") from None
    return GradingPlan(image=image, workdir=str(workdir),
                       base_commit=runtime.base_commit if runtime is not None else None,
                       fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass, test_patch=test_patch,
                       test_cmd=test_cmd, timeout_s=timeout_s, init_timeout_s=init_timeout_s)


def listed_test_files(test_ids: Sequence[str]) -> list[str]:
    """The test files pytest node ids name (``path::name`` → ``path``), in order, each once."""
    files: dict[str, None] = {}
    for test_id in test_ids:
        path = test_id.split("::", 1)[0].strip()
        if "::" in test_id or path.endswith(".py"):
            files[path] = None
    return list(files)


def patch_paths(diff: str) -> list[str]:
    """The paths a unified diff touches (both sides of each ``diff --git`` header, or ``---``/``+++``)."""
    paths: dict[str, None] = {}
    for line in diff.splitlines():
        match = _DIFF_GIT.match(line)
        if match:
            paths.update({match.group(1): None, match.group(2): None})
        elif line.startswith(("--- a/", "+++ b/")):
            paths[line[6:].split("\t", 1)[0].strip()] = None
    return list(paths)


def parse_summary(output: str) -> list[tuple[str, str]]:
    """pytest ``-rA`` short-summary lines as (status, rest): rest is the node id, then `` - message``."""
    return [(m.group(1), m.group(2).rstrip()) for m in map(_SUMMARY_LINE.match, output.splitlines()) if m]


def outcomes_for(test_ids: Sequence[str], summary: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Each listed test's outcome (lowercase status, or 'missing'). A test both passed and errored (in
    teardown) counts as errored."""
    outcomes: dict[str, str] = {}
    for test_id in test_ids:
        seen = [status.lower() for status, rest in summary if rest == test_id or rest.startswith(test_id + " - ")]
        failing = [status for status in seen if status in _FAILING_FIRST]
        outcomes[test_id] = failing[0] if failing else (seen[-1] if seen else "missing")
    return outcomes



class SwebenchEvaluator(ContainerEvaluator):
    """Resolved or not, SWE-bench's way, in a fresh container of the task image."""

    name = "swebench"
    version = "1"

    def runtime_spec(self, plan: GradingPlan) -> RuntimeSpec:
        """The grading container: the image's own repository at the base commit, no network."""
        return RuntimeSpec(kind="docker", image=plan.image, workdir=plan.workdir, base_commit=plan.base_commit,
                           repo=None, network="none")

    async def evaluate(self, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation:
        details: dict[str, Any] = {"session_status": ended.status.value}
        try:
            plan = plan_from(self.settings_for(spec), spec)
            plan.test_argv("/dev/null")  # checked here, before any container starts
        except EvaluatorConfigError as exc:
            return self.failed(ended, spec, f"bad settings: {exc}", details)
        details["image"] = plan.image
        patch = ended.patch or ""
        if not patch.strip():
            return self._unresolved(ended, spec, details, "empty patch: the session changed nothing")
        try:
            handle = await self.runtime().init(f"swebench-eval-{ended.session_id}", self.runtime_spec(plan),
                                               timeout_s=plan.init_timeout_s)
        except RuntimeInitError as exc:
            return self.failed(ended, spec, f"grading container: {exc}", details)
        try:
            return await self._grade(ended, spec, plan, handle, patch, details)
        finally:
            await asyncio.shield(handle.teardown())

    async def _grade(self, ended: SessionEnded, spec: SessionSpec | None, plan: GradingPlan, handle: RuntimeHandle,
                     patch: str, details: dict[str, Any]) -> Evaluation:
        directory = f"{handle.home}/{_EVAL_DIR}"
        model_patch, test_patch, log = (f"{directory}/model.patch", f"{directory}/test.patch",
                                        f"{directory}/tests.log")
        await handle.write_home_files({f"{_EVAL_DIR}/model.patch": _with_newline(patch),
                                       f"{_EVAL_DIR}/test.patch": _with_newline(plan.test_patch)})
        applied_by, apply_output = await self._apply_session_patch(handle, model_patch)
        details["patch_apply_output"] = apply_output
        if applied_by is None:
            return self._unresolved(ended, spec, details, "patch does not apply (neither git apply nor "
                                    f"patch --fuzz={PATCH_FUZZ})")
        details["patch_applied_by"] = applied_by
        if plan.test_patch.strip():
            error = await self._apply_test_patch(handle, plan.test_patch, test_patch)
            if error is not None:
                return self.failed(ended, spec, f"settings.test_patch does not apply after the session's patch: "
                                   f"{error}", details)
        argv = plan.test_argv(log)
        details["test_command"] = plan.test_cmd or shlex.join(argv[4:])
        outcome = await handle.run(argv, env={}, timeout_s=plan.timeout_s)
        summary_lines, _, output = (await self._test_output(handle, log)).partition(_TAIL_MARK)
        summary = parse_summary(summary_lines)
        outcomes = outcomes_for(plan.listed, summary)
        f2p_failing = [t for t in plan.fail_to_pass if outcomes[t] not in PASSING]
        p2p_failing = [t for t in plan.pass_to_pass if outcomes[t] not in PASSING]
        resolved = not outcome.timed_out and not f2p_failing and not p2p_failing
        details.update(resolved=resolved, tests=outcomes, fail_to_pass_failing=f2p_failing,
                       pass_to_pass_failing=p2p_failing, exit_code=outcome.exit_code, timed_out=outcome.timed_out,
                       duration_s=round(outcome.duration_s, 3),
                       output=output.strip("\n")[-OUTPUT_TAIL_CHARS:])
        if outcome.timed_out:
            details["reason"] = f"tests did not finish within {plan.timeout_s:g} s"
        elif not resolved:
            details["reason"] = (f"{len(f2p_failing)} of {len(plan.fail_to_pass)} FAIL_TO_PASS and "
                                 f"{len(p2p_failing)} of {len(plan.pass_to_pass)} PASS_TO_PASS tests do not pass")
        return self.result(ended, spec, reward=1.0 if resolved else 0.0, passed=resolved, details=details)

    def _unresolved(self, ended: SessionEnded, spec: SessionSpec | None, details: dict[str, Any],
                    reason: str) -> Evaluation:
        return self.result(ended, spec, reward=0.0, passed=False,
                           details={**details, "resolved": False, "reason": reason})

    async def _apply_session_patch(self, handle: RuntimeHandle, path: str) -> tuple[str | None, dict[str, str]]:
        """Which tool applied the patch (None: neither) and what each one said."""
        said: dict[str, str] = {}
        git = await handle.run(["git", "apply", "--verbose", "--whitespace=nowarn", path], env={},
                               timeout_s=PATCH_TIMEOUT_S)
        said["git apply"] = output_tail(git)
        if git.exit_code == 0:
            return "git apply", said
        fuzzy = await handle.run(["patch", "--batch", f"--fuzz={PATCH_FUZZ}", "-p1", "--no-backup-if-mismatch",
                                  "-i", path], env={}, timeout_s=PATCH_TIMEOUT_S)
        tool = f"patch --fuzz={PATCH_FUZZ}"
        said[tool] = output_tail(fuzzy)
        return (tool if fuzzy.exit_code == 0 else None), said

    async def _apply_test_patch(self, handle: RuntimeHandle, diff: str, path: str) -> str | None:
        """Reset the files the test patch touches to the base commit, apply it; git's reason if it fails."""
        paths = patch_paths(diff)
        if paths:
            reset = ('for p in "$@"; do if git cat-file -e HEAD:"$p" 2>/dev/null; then '
                     'git checkout -q HEAD -- "$p"; else rm -f -- "$p"; fi; done')
            result = await handle.run(["sh", "-c", reset, "sh", *paths], env={}, timeout_s=PATCH_TIMEOUT_S)
            if result.exit_code != 0:
                return f"resetting the test files failed: {output_tail(result)}"
        result = await handle.run(["git", "apply", "--verbose", "--whitespace=nowarn", path], env={},
                                  timeout_s=PATCH_TIMEOUT_S)
        return None if result.exit_code == 0 else output_tail(result) or f"git apply exited {result.exit_code}"

    async def _test_output(self, handle: RuntimeHandle, log: str) -> str:
        """The summary lines of the test log, then its tail after a marker (the whole log may be large)."""
        script = (f"grep -E '^({'|'.join(STATUSES)}) ' \"$1\"; echo {_TAIL_MARK}; "
                  f"tail -c {OUTPUT_TAIL_CHARS} \"$1\"")
        result = await handle.run(["sh", "-c", script, "sh", log], env={}, timeout_s=PATCH_TIMEOUT_S)
        return result.stdout


def _with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"
