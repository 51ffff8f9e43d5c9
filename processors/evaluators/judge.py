"""The ``judge`` evaluator: a rubric judge, composed with any other evaluator's outcome.

``reward = outcome + coefficient × score / scale``. The outcome is another registered evaluator's reward
(``settings.outcome``: ``{"name": "harbor", "settings": {...}}``, run here on the same session as if its
spec named it), or 0 without one; the score is an LLM judge's, on the task's rubric
(processors/evaluators/judge_client.py). One evaluation carries both: ``details.outcome`` (the other
evaluator's reward, passed and details), ``details.judge`` (schemas.judge.Judgement: the judge's model and
URL, the prompt's digest, every attempt's raw answer, the parsed score and reason) and the formula's terms.

Status 'error' (the sample is then kept out of the baseline, never scored a silent 0): the outcome
evaluator's own error, or a judgement that failed after its retries (unreachable, timed out, an answer
outside the structured form); the failed judgement's record is still in ``details.judge``.

The judge is called directly at ``settings.url`` (default ``ROLLWIRE_JUDGE_URL``, the embedded engine): its
calls are not the policy's, so they never pass a session's proxy and never appear on ``completions``.
``passed`` is the outcome's (a judge's opinion does not make a failing test pass).

Settings: ``rubric`` (required), ``outcome``, ``coefficient`` (1), ``scale`` (10), and overrides of the
ROLLWIRE_JUDGE_* defaults: ``url``, ``model``, ``api_key``, ``timeout_s``, ``max_attempts``, ``max_tokens``,
``answer_chars``, ``patch_chars``; ``extra_body`` (request fields merged over the body).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from processors.evaluators.base import Evaluator, EvaluatorConfigError
from processors.evaluators.judge_client import JudgeFailed, JudgeRequest, judge
from processors.evaluators.judge_settings import JudgeSettings
from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec
from schemas.tasks import EvaluatorSpec

ANSWER_ARTIFACT = "harness_stdout_tail"
"""The session's final answer: what the harness printed last (a headless CLI prints its answer)."""

OutcomeFactory = Callable[[str], Evaluator]


def _from_registry(name: str) -> Evaluator:
    """An instance of the registered evaluator ``name`` (the registry hands itself to the judge class)."""
    if name == JudgeEvaluator.name:
        raise EvaluatorConfigError("settings.outcome cannot be the judge itself")
    try:
        return JudgeEvaluator.registry[name]()
    except KeyError:
        raise EvaluatorConfigError(f"settings.outcome names no evaluator {name!r}; known: "
                                   f"{', '.join(sorted(JudgeEvaluator.registry))}") from None


def request_from(settings: Mapping[str, Any], defaults: JudgeSettings, ended: SessionEnded,
                 spec: SessionSpec | None) -> JudgeRequest:
    """The judgement's request; EvaluatorConfigError says what is missing or malformed."""
    rubric = settings.get("rubric")
    if not isinstance(rubric, str) or not rubric.strip():
        raise EvaluatorConfigError("settings.rubric (the task's rubric, a non-empty string) is missing")
    extra = settings.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise EvaluatorConfigError("settings.extra_body must be an object")
    try:
        scale = float(settings.get("scale", 10.0))
        coefficient = float(settings.get("coefficient", 1.0))
        if scale <= 0:
            raise ValueError("scale must be above 0")
        return JudgeRequest(
            url=str(settings.get("url") or defaults.url), model=str(settings.get("model") or defaults.model),
            rubric=rubric, instruction=(spec.instruction if spec is not None else None) or "(no instruction)",
            answer=ended.artifacts.get(ANSWER_ARTIFACT, ""), patch=ended.patch or "", scale=scale,
            coefficient=coefficient, api_key=settings.get("api_key") or defaults.api_key,
            timeout_s=float(settings.get("timeout_s", defaults.timeout_s)),
            max_attempts=int(settings.get("max_attempts", defaults.max_attempts)),
            max_tokens=int(settings.get("max_tokens", defaults.max_tokens)),
            answer_chars=int(settings.get("answer_chars", defaults.answer_chars)),
            patch_chars=int(settings.get("patch_chars", defaults.patch_chars)), extra_body=dict(extra))
    except (TypeError, ValueError) as exc:
        raise EvaluatorConfigError(f"judge settings: {exc}") from None


class JudgeEvaluator(Evaluator):
    """Another evaluator's outcome plus an LLM judge's rubric score, in one evaluation."""

    name = "judge"
    version = "1"
    registry: ClassVar[Mapping[str, type[Evaluator]]] = {}
    """The evaluators an outcome may name: processors.evaluators sets it to EVALUATORS (this module cannot
    import the registry, which imports it)."""

    def __init__(self, settings: dict[str, Any] | None = None, *, outcome_factory: OutcomeFactory | None = None,
                 judge_settings: JudgeSettings | None = None) -> None:
        super().__init__(settings)
        self._factory = outcome_factory or _from_registry
        self._outcomes: dict[str, Evaluator] = {}
        self.defaults = judge_settings or JudgeSettings()

    def _outcome_evaluator(self, name: str) -> Evaluator:
        if name not in self._outcomes:
            self._outcomes[name] = self._factory(name)
        return self._outcomes[name]

    async def _outcome(self, outcome: Any, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation | None:
        """The other evaluator's verdict on this session, as if the spec named it (None: no outcome)."""
        if outcome is None:
            return None
        try:
            inner = EvaluatorSpec.model_validate(outcome)
        except ValueError as exc:
            raise EvaluatorConfigError(f"settings.outcome must be {{name, settings}}: {exc}") from None
        evaluator = self._outcome_evaluator(inner.name)
        inner_spec = spec.model_copy(update={"evaluator": inner}) if spec is not None else None
        if inner_spec is None:
            evaluator = type(evaluator)(inner.settings)
        return await evaluator.evaluate(ended, inner_spec)

    async def evaluate(self, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation:
        settings = self.settings_for(spec)
        try:
            request = request_from(settings, self.defaults, ended, spec)
            outcome = await self._outcome(settings.get("outcome"), ended, spec)
        except EvaluatorConfigError as exc:
            return self.failed(ended, spec, f"bad settings: {exc}")
        details: dict[str, Any] = {"session_status": ended.status.value}
        if outcome is not None:
            details["outcome"] = {"evaluator": outcome.evaluator, "status": outcome.status, "reward": outcome.reward,
                                  "passed": outcome.passed, "details": outcome.details}
            if outcome.status == "error":
                return self.failed(ended, spec, f"the outcome evaluator {outcome.evaluator} failed: {outcome.error}",
                                   details)
        try:
            answer, record = await judge(request)
        except JudgeFailed as exc:
            details["judge"] = exc.judgement.model_dump(mode="json")
            return self.failed(ended, spec, str(exc), details)
        outcome_reward = outcome.reward if outcome is not None and outcome.reward is not None else 0.0
        bonus = request.coefficient * answer.score / request.scale
        details["judge"] = record.model_dump(mode="json")
        details.update(outcome_reward=outcome_reward, judge_score=answer.score, judge_term=bonus,
                       formula="outcome + coefficient * score / scale")
        return self.result(ended, spec, reward=outcome_reward + bonus,
                           passed=outcome.passed if outcome is not None else None, details=details)
