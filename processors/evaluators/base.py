"""The evaluator contract: a small class that turns a session's end (and its spec) into an Evaluation.

Adding an evaluator is writing a subclass with a ``name``, a ``version`` and :meth:`Evaluator.evaluate`,
and registering it in :mod:`processors.evaluators` (``EVALUATORS``); ``rollwire evaluator run NAME`` then
runs it as a consumer (processors/evaluators/runner.py). Build the result with :meth:`Evaluator.result`
or :meth:`Evaluator.failed`: they fill the evaluator's name and version, the session and task ids, and
a deterministic event id (evaluator, version and the session end event's id), so scoring the same end
twice (a redelivery, a replay) gives the same event and readers de-duplicate it.
"""

from __future__ import annotations

import abc
import uuid
from typing import Any, ClassVar

from processors.errors import ProcessorError
from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec

_EVALUATION_NAMESPACE = uuid.UUID("5b0a64e4-7f0c-4c7e-9c53-2f7f4e1c9a10")


class EvaluatorError(ProcessorError):
    """Base class for evaluator failures."""


class EvaluatorConfigError(EvaluatorError):
    """The evaluator's settings (from the session spec or the command line) are unusable."""


def evaluation_event_id(evaluator: str, version: str, ended: SessionEnded) -> str:
    """The event id of ``evaluator``@``version``'s verdict on this session end (stable across replays)."""
    return uuid.uuid5(_EVALUATION_NAMESPACE, f"{evaluator}\x00{version}\x00{ended.event_id}").hex


class Evaluator(abc.ABC):
    """Scores ended sessions. One instance serves a whole consumer; ``evaluate`` may run concurrently."""

    name: ClassVar[str]
    version: ClassVar[str]

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        self.default_settings: dict[str, Any] = dict(settings or {})
        """Settings from the command line, used where the session spec names none (``--all``)."""

    def settings_for(self, spec: SessionSpec | None) -> dict[str, Any]:
        """The command line's settings overlaid with the spec's, when the spec names this evaluator."""
        merged = dict(self.default_settings)
        if spec is not None and spec.evaluator is not None and spec.evaluator.name == self.name:
            merged.update(spec.evaluator.settings)
        return merged

    @abc.abstractmethod
    async def evaluate(self, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation:
        """The verdict on one ended session. Raise only for an unexpected failure: the runner turns it into
        an evaluation with status 'error'."""

    def _task_id(self, ended: SessionEnded, spec: SessionSpec | None) -> str | None:
        return ended.task_id or (spec.task_id if spec is not None else None)

    def result(self, ended: SessionEnded, spec: SessionSpec | None, *, reward: float, passed: bool | None = None,
               details: dict[str, Any] | None = None) -> Evaluation:
        """An 'ok' evaluation with this reward."""
        return Evaluation(event_id=evaluation_event_id(self.name, self.version, ended), session_id=ended.session_id,
                          task_id=self._task_id(ended, spec), evaluator=self.name,
                          evaluator_version=self.version, reward=reward, passed=passed, details=details or {})

    def failed(self, ended: SessionEnded, spec: SessionSpec | None, error: str,
               details: dict[str, Any] | None = None) -> Evaluation:
        """An 'error' evaluation: the evaluator could not score the session (not the policy's fault)."""
        return Evaluation(event_id=evaluation_event_id(self.name, self.version, ended), session_id=ended.session_id,
                          task_id=self._task_id(ended, spec), evaluator=self.name,
                          evaluator_version=self.version, status="error", error=error[:4000],
                          details=details or {})
