"""The ``session_completed`` evaluator: reward 1 if the session ended without error, else 0."""

from __future__ import annotations

from typing import Any

from schemas.evaluations import Evaluation
from schemas.sessions import SessionEnded, SessionSpec, SessionStatus

from processors.evaluators.base import Evaluator


class SessionCompleted(Evaluator):
    """1.0 for status ``completed``, 0.0 for ``error``, ``timeout`` and ``cancelled``."""

    name = "session_completed"
    version = "1"

    async def evaluate(self, ended: SessionEnded, spec: SessionSpec | None) -> Evaluation:
        passed = ended.status is SessionStatus.COMPLETED
        details: dict[str, Any] = {"status": ended.status.value}
        if ended.failure is not None:
            details["failure"] = ended.failure.value
        if ended.reason:
            details["reason"] = ended.reason[:2000]
        if ended.exit_code is not None:
            details["exit_code"] = ended.exit_code
        return self.result(ended, spec, reward=1.0 if passed else 0.0, passed=passed, details=details)
