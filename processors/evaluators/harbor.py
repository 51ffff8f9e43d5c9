"""The ``harbor`` evaluator: a Harbor task's verifier, run in a fresh container of the task's image.

For every ended session: a new container of ``settings.image`` (the environment image the session ran
in, schemas/harbor.py), started through producers.runtimes.docker with no network, its workspace the
image's WORKDIR at the commit the image build made of it. In it, in order:

1. the session's changes (``SessionEnded.patch``, the WORKDIR's diff) by ``git apply``; an empty patch is
   nothing to apply (the verifier still runs: the reward is what it says of the untouched environment);
2. the task's ``tests/`` (mounted read-only from ``settings.tests_dir``) copied to ``/tests``, and
   ``/logs/verifier`` made empty, as Harbor does, so that nothing the session left there counts;
3. ``bash /tests/test.sh`` in the WORKDIR with ``settings.env``, bounded by ``settings.timeout_s`` (the
   task's ``[verifier] timeout_sec``);
4. the reward from ``/logs/verifier/reward.txt`` (one number) or ``reward.json`` (an object of numbers:
   its ``reward``, else its only value; every value is kept in ``details.rewards``).

A verifier run past its timeout scores 0 (``details.timed_out``: like a test run past its limit, the
policy's doing). Status 'error', never a silent 0: no reward file, a reward that is not a number, changes
that do not apply to a fresh container of the same image, no engine or image, bad settings. ``passed`` is
reward >= 1. The container is removed on every path.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from processors.evaluators.base import EvaluatorConfigError
from processors.evaluators.containers import ContainerEvaluator, output_tail
from producers.runtimes.base import RuntimeHandle, RuntimeInitError
from schemas.evaluations import Evaluation
from schemas.harbor import DEFAULT_VERIFIER_TIMEOUT_S, TESTS_MOUNT, VERIFIER_LOGS, VERIFIER_TESTS
from schemas.sessions import SessionEnded, SessionSpec
from schemas.tasks import RuntimeSpec

DEFAULT_INIT_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 120.0
REWARD_FILE_BYTES = 65536
_EVAL_DIR = "harbor-eval"
_PREPARE = (f'rm -rf {VERIFIER_TESTS} {VERIFIER_LOGS} && mkdir -p {VERIFIER_TESTS} {VERIFIER_LOGS} /logs/agent '
            f'&& cp -a {TESTS_MOUNT}/. {VERIFIER_TESTS}/')
_READ_REWARD = (f'for f in {VERIFIER_LOGS}/reward.txt {VERIFIER_LOGS}/reward.json; do '
                f'if [ -f "$f" ]; then echo "$f"; head -c {REWARD_FILE_BYTES} "$f"; exit 0; fi; done; exit 7')


class RewardFileError(ValueError):
    """The verifier's reward file is missing or does not hold a reward."""


@dataclass(frozen=True, slots=True)
class VerifierPlan:
    """What one verification needs, read from the settings."""

    image: str
    tests_dir: str
    timeout_s: float
    env: dict[str, str]
    init_timeout_s: float


def plan_from(settings: Mapping[str, Any], spec: SessionSpec | None) -> VerifierPlan:
    """The plan; EvaluatorConfigError says what is missing or malformed."""
    image = settings.get("image") or (spec.runtime.image if spec is not None else None)
    if not isinstance(image, str) or not image:
        raise EvaluatorConfigError("no image: settings.image or the session's runtime.image is needed")
    tests_dir = settings.get("tests_dir")
    if not isinstance(tests_dir, str) or not Path(tests_dir, "test.sh").is_file():
        raise EvaluatorConfigError(f"settings.tests_dir must be a folder holding test.sh, got {tests_dir!r}")
    env = settings.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise EvaluatorConfigError("settings.env must map names to strings")
    try:
        timeout_s = float(settings.get("timeout_s", DEFAULT_VERIFIER_TIMEOUT_S))
        init_timeout_s = float(settings.get("init_timeout_s", DEFAULT_INIT_TIMEOUT_S))
    except (TypeError, ValueError) as exc:
        raise EvaluatorConfigError(f"timeouts: {exc}") from None
    return VerifierPlan(image, str(Path(tests_dir).resolve()), timeout_s, dict(env), init_timeout_s)


def parse_reward(name: str, text: str) -> tuple[float, dict[str, float]]:
    """The reward a reward file holds, and every named value (``reward.json``); RewardFileError says why not."""
    if name.endswith(".txt"):
        try:
            value = float(text.strip())
        except ValueError:
            raise RewardFileError(f"reward.txt holds {text.strip()[:200]!r}, not a number") from None
        rewards = {"reward": value}
    else:
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RewardFileError(f"reward.json is not JSON: {exc.msg}") from None
        if not isinstance(document, dict) or not document or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in document.values()):
            raise RewardFileError(f"reward.json must be an object of numbers, got {text.strip()[:200]!r}")
        rewards = {str(k): float(v) for k, v in document.items()}
        if "reward" in rewards:
            value = rewards["reward"]
        elif len(rewards) == 1:
            value = next(iter(rewards.values()))
        else:
            raise RewardFileError(f"reward.json names several rewards ({', '.join(rewards)}) and none is 'reward'")
    if not all(math.isfinite(v) for v in rewards.values()):
        raise RewardFileError("the reward is not a finite number")
    return value, rewards



class HarborEvaluator(ContainerEvaluator):
    """A Harbor task's verifier in a fresh container of its image, the session's changes applied."""

    name = "harbor"
    version = "1"

    @staticmethod
    def runtime_spec(plan: VerifierPlan) -> RuntimeSpec:
        """The verifier's container: the image's WORKDIR at its commit, no network, the tests mounted."""
        return RuntimeSpec(kind="docker", image=plan.image, repo=None, network="none",
                           mounts=[f"{plan.tests_dir}:{TESTS_MOUNT}:ro"])

    async def evaluate(self, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation:
        details: dict[str, Any] = {"session_status": ended.status.value}
        try:
            plan = plan_from(self.settings_for(spec), spec)
        except EvaluatorConfigError as exc:
            return self.failed(ended, spec, f"bad settings: {exc}", details)
        details["image"] = plan.image
        try:
            handle = await self.runtime().init(f"harbor-eval-{ended.session_id}", self.runtime_spec(plan),
                                               timeout_s=plan.init_timeout_s)
        except RuntimeInitError as exc:
            return self.failed(ended, spec, f"verifier container: {exc}", details)
        try:
            return await self._verify(ended, spec, plan, handle, details)
        finally:
            await asyncio.shield(handle.teardown())

    async def _verify(self, ended: SessionEnded, spec: SessionSpec | None, plan: VerifierPlan,
                      handle: RuntimeHandle, details: dict[str, Any]) -> Evaluation:
        patch = ended.patch or ""
        details["patch_bytes"] = len(patch.encode())
        if patch.strip():
            await handle.write_home_files({f"{_EVAL_DIR}/session.patch": patch if patch.endswith("\n") else patch + "\n"})
            applied = await handle.run(["git", "apply", "--verbose", "--whitespace=nowarn",
                                        f"{handle.home}/{_EVAL_DIR}/session.patch"], env={}, timeout_s=STEP_TIMEOUT_S)
            if applied.exit_code != 0:
                return self.failed(ended, spec, "the session's changes do not apply to a fresh container of "
                                   f"{plan.image}: {output_tail(applied)}", details)
        prepared = await handle.run(["sh", "-c", _PREPARE], env={}, timeout_s=STEP_TIMEOUT_S)
        if prepared.exit_code != 0:
            return self.failed(ended, spec, f"copying the tests to {VERIFIER_TESTS} failed: {output_tail(prepared)}",
                               details)
        outcome = await handle.run(["bash", f"{VERIFIER_TESTS}/test.sh"], env=plan.env, timeout_s=plan.timeout_s)
        details.update(verifier_exit_code=outcome.exit_code, timed_out=outcome.timed_out,
                       duration_s=round(outcome.duration_s, 3), output=output_tail(outcome).strip("\n"),
                       test_command=shlex.join(["bash", f"{VERIFIER_TESTS}/test.sh"]))
        if outcome.timed_out:
            return self.result(ended, spec, reward=0.0, passed=False, details={
                **details, "reason": f"the verifier did not finish within {plan.timeout_s:g} s"})
        found = await handle.run(["sh", "-c", _READ_REWARD], env={}, timeout_s=STEP_TIMEOUT_S)
        if found.exit_code != 0:
            return self.failed(ended, spec, f"the verifier wrote no reward file ({VERIFIER_LOGS}/reward.txt or "
                               f"reward.json; test.sh exited {outcome.exit_code})", details)
        path, _, text = found.stdout.partition("\n")
        details["reward_file"] = path
        try:
            reward, rewards = parse_reward(path, text)
        except RewardFileError as exc:
            return self.failed(ended, spec, str(exc), details)
        details["rewards"] = rewards
        return self.result(ended, spec, reward=reward, passed=reward >= 1.0, details=details)
