"""The ``tests`` evaluator: apply the session's patch to a fresh runtime and run the task's tests.

SWE-style pass/fail. Steps: a fresh runtime from the session's own ``RuntimeSpec`` (the repository at its
base commit, the set-up commands: producers.runtimes, the same code the session ran in), the session's
patch (``SessionEnded.patch``), then ``settings.test_patch`` if given (hidden tests the harness never saw),
then ``settings.command`` with ``settings.timeout_s``. Reward 1.0 if the command exits 0, else 0.0.

The runtime is docker where the spec says docker and a docker engine answers, else local (a docker spec
scored locally says so in ``details.runtime``: the issue asks for docker "where it answers"). A docker
grading container has no network (``network: none``: a grader needs no proxy). Patches are applied with
``git apply`` (checked first, so a refused patch changes nothing) on this machine where the workspace is
here (the local runtime, or a docker spec with ``repo``: bind-mounted), and inside the container where the
workspace is the image's own repository (a docker spec without ``repo``, e.g. ``/testbed`` of a SWE-style
task image; ``details.patch_applied_in`` says which).

Settings (the session spec's ``evaluator.settings``, over the command line's ``--settings``):
``command`` (required; a shell string run with ``sh -c``, or an argv list), ``timeout_s`` (600),
``test_patch`` (optional diff), ``setup`` (true: run ``runtime.setup`` first), ``env`` (extra variables),
``init_timeout_s`` (1800: checkout and set-up).

Verdicts: an empty patch or one that does not apply scores 0 with the reason in ``details``; a test run
past its timeout scores 0 (``details.timed_out``). What the policy cannot be blamed for (no command in
the settings, a checkout or set-up command that fails, a hidden test patch that does not apply) gives an
evaluation with status 'error'. Sessions that did not complete are scored too (a timed-out session's
patch may still pass; ``details.session_status`` says how it ended): whether such a reward is trained on is
the groups worker's call (processors/groups/advantages.py keeps failed sessions out of baselines).
"""

from __future__ import annotations

import asyncio
import shlex
import tempfile
from pathlib import Path
from typing import Any

from processors.evaluators.base import Evaluator, EvaluatorConfigError
from processors.evaluators.checkout import PatchDoesNotApply, apply_patch
from producers.runtimes.base import Runtime, RuntimeHandle, RuntimeInitError
from producers.runtimes.local import LocalRuntime
from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec
from schemas.tasks import RuntimeSpec

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_INIT_TIMEOUT_S = 1800.0
OUTPUT_TAIL_CHARS = 4000
PATCH_TIMEOUT_S = 120.0
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}


def _argv(command: Any) -> list[str]:
    if isinstance(command, str) and command.strip():
        return ["sh", "-c", command]
    if isinstance(command, list) and command and all(isinstance(part, str) for part in command):
        return list(command)
    raise EvaluatorConfigError("settings.command must be a shell string or a non-empty list of strings, "
                               f"got {command!r}")


def _host_workspace(handle: RuntimeHandle) -> Path | None:
    """The workspace as this machine sees it (a docker handle bind-mounts it from here); None when it is
    inside the container (a docker handle's workspace in the image)."""
    if not hasattr(handle, "host_workspace"):  # the local runtime: the workspace is here
        return Path(handle.workspace)
    host = getattr(handle, "host_workspace")  # noqa: B009 - not every handle has it
    return None if host is None else Path(host)


async def _apply_in_runtime(handle: RuntimeHandle, patch: str, *, timeout_s: float = PATCH_TIMEOUT_S) -> None:
    """Apply ``patch`` to the workspace by ``git apply`` run in the runtime (checked first, so a refused
    patch changes nothing); PatchDoesNotApply with git's reason if it refuses."""
    data = patch if patch.endswith("\n") else patch + "\n"
    for check in (["--check"], []):
        result = await handle.run(["git", "apply", *check, "--whitespace=nowarn", "-"], env=_GIT_ENV,
                                  timeout_s=timeout_s, stdin=data)
        if result.timed_out:
            raise PatchDoesNotApply(f"git apply did not finish within {timeout_s:g} s")
        if result.exit_code != 0:
            said = (result.stderr or result.stdout).strip()[-2000:]
            raise PatchDoesNotApply(said or f"git apply exited {result.exit_code}")


async def _apply(handle: RuntimeHandle, patch: str) -> str:
    """Apply ``patch`` to the handle's workspace, here or in the container; where it was applied."""
    workspace = _host_workspace(handle)
    if workspace is None:
        await _apply_in_runtime(handle, patch)
        return "container"
    await apply_patch(workspace, patch)
    return "host"


class TestsEvaluator(Evaluator):
    """Pass/fail of the task's test command on the session's patch."""

    __test__ = False  # not a pytest class, despite the name
    name = "tests"
    version = "1"

    def __init__(self, settings: dict[str, Any] | None = None, *, scratch: Path | None = None) -> None:
        super().__init__(settings)
        self.scratch = scratch or Path(tempfile.gettempdir()) / "rollwire-evaluations"
        self._docker: Runtime | None = None

    async def _runtime(self, spec: RuntimeSpec) -> tuple[Runtime, str]:
        """The runtime to score in, and how ``details.runtime`` names it."""
        if spec.kind != "docker":
            return LocalRuntime(self.scratch), "local"
        try:
            from producers.runtimes.docker import DockerRuntime, docker_client

            await asyncio.to_thread(docker_client)
        except (ImportError, RuntimeInitError) as exc:
            return LocalRuntime(self.scratch), f"local (runtime is docker but {exc})"
        if self._docker is None:
            self._docker = DockerRuntime(self.scratch, mount_harness_cache=False)
        return self._docker, "docker"

    async def evaluate(self, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation:
        settings = self.settings_for(spec)
        details: dict[str, Any] = {"session_status": ended.status.value}
        try:
            argv = _argv(settings.get("command"))
            timeout_s = float(settings.get("timeout_s", DEFAULT_TIMEOUT_S))
            init_timeout_s = float(settings.get("init_timeout_s", DEFAULT_INIT_TIMEOUT_S))
            env = {str(k): str(v) for k, v in dict(settings.get("env") or {}).items()}
        except (EvaluatorConfigError, TypeError, ValueError) as exc:
            return self.failed(ended, spec, f"bad settings: {exc}", details)
        if not (ended.patch or "").strip():
            return self.result(ended, spec, reward=0.0, passed=False,
                               details={**details, "reason": "empty patch: the session changed nothing"})
        runtime_spec = spec.runtime if spec is not None else RuntimeSpec()
        if not settings.get("setup", True):
            runtime_spec = runtime_spec.model_copy(update={"setup": []})
        runtime, details["runtime"] = await self._runtime(runtime_spec)
        if runtime.kind == "local" and runtime_spec.kind == "docker":
            runtime_spec = runtime_spec.model_copy(update={"kind": "local"})
        elif runtime.kind == "docker":
            runtime_spec = runtime_spec.model_copy(update={"network": "none"})
        try:
            handle = await runtime.init(f"eval-{ended.session_id}", runtime_spec, timeout_s=init_timeout_s)
        except RuntimeInitError as exc:
            return self.failed(ended, spec, f"runtime: {exc}", details)
        try:
            details["base_commit"] = getattr(handle, "base_commit", None)
            try:
                details["patch_applied_in"] = await _apply(handle, ended.patch or "")
            except PatchDoesNotApply as exc:
                return self.result(ended, spec, reward=0.0, passed=False,
                                   details={**details, "reason": f"patch does not apply: {exc}"})
            if settings.get("test_patch"):
                try:
                    await _apply(handle, str(settings["test_patch"]))
                except PatchDoesNotApply as exc:
                    return self.failed(ended, spec, f"settings.test_patch does not apply after the session's "
                                       f"patch: {exc}", details)
            outcome = await handle.run(argv, env=env, timeout_s=timeout_s)
        finally:
            await asyncio.shield(handle.teardown())
        passed = outcome.exit_code == 0 and not outcome.timed_out
        details.update(command=" ".join(shlex.quote(a) for a in argv), exit_code=outcome.exit_code,
                       timed_out=outcome.timed_out, duration_s=round(outcome.duration_s, 3),
                       output=(outcome.stdout + outcome.stderr)[-OUTPUT_TAIL_CHARS:])
        if outcome.timed_out:
            details["reason"] = f"tests did not finish within {timeout_s:g} s"
        elif not passed:
            details["reason"] = f"tests failed (exit code {outcome.exit_code})"
        return self.result(ended, spec, reward=1.0 if passed else 0.0, passed=passed, details=details)
