"""Evaluators: consumers that score ended sessions and emit Evaluation events on `evaluations`.

``EVALUATORS`` maps a name to its class; ``rollwire evaluator run NAME`` looks the name up here.
Adding an evaluator: subclass :class:`~processors.evaluators.base.Evaluator` and add it below.
"""

from __future__ import annotations

from processors.evaluators.base import Evaluator, EvaluatorConfigError, EvaluatorError
from processors.evaluators.harbor import HarborEvaluator
from processors.evaluators.judge import JudgeEvaluator
from processors.evaluators.session_completed import SessionCompleted
from processors.evaluators.swebench import SwebenchEvaluator
from processors.evaluators.tests_evaluator import TestsEvaluator

EVALUATORS: dict[str, type[Evaluator]] = {
    SessionCompleted.name: SessionCompleted,
    TestsEvaluator.name: TestsEvaluator,
    SwebenchEvaluator.name: SwebenchEvaluator,
    HarborEvaluator.name: HarborEvaluator,
    JudgeEvaluator.name: JudgeEvaluator,
}
JudgeEvaluator.registry = EVALUATORS  # the outcomes a judge may compose with


class UnknownEvaluator(EvaluatorError):
    """No evaluator is registered under that name."""


def evaluator_class(name: str) -> type[Evaluator]:
    """The registered class for ``name``; UnknownEvaluator lists the known ones."""
    try:
        return EVALUATORS[name]
    except KeyError:
        raise UnknownEvaluator(f"no evaluator named {name!r}; known: {', '.join(sorted(EVALUATORS))}") from None


__all__ = ["EVALUATORS", "Evaluator", "EvaluatorConfigError", "EvaluatorError", "UnknownEvaluator", "evaluator_class"]
