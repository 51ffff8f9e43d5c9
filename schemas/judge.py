"""An LLM judge's verdict: the structured answer it must give, and the record an evaluation carries of it.

The judge (processors/evaluators/judge.py) asks an OpenAI-compatible endpoint to score a session by a
rubric and must get back :class:`JudgeAnswer` (``{"score": number, "reason": string}``), requested through
structured outputs (:func:`answer_schema`). Every judgement, good or failed, is written on the evaluation
as a :class:`Judgement` (``details.judge``): which model, a digest of the exact prompt, every attempt's raw
answer and error, the parsed score. Nothing about it is inferred later: a replay reads what was judged.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from schemas.envelope import Model

REASON_MAX_CHARS = 1000


class JudgeAnswer(Model):
    """The judge's answer, exactly this shape (no other field)."""

    model_config = ConfigDict(extra="forbid")

    score: float = Field(description="The rubric's score, 0 to the scale.")
    reason: str = Field(max_length=REASON_MAX_CHARS, description="Why, briefly.")


def answer_schema(scale: float) -> dict[str, Any]:
    """The JSON schema of :class:`JudgeAnswer` for a score out of ``scale`` (structured outputs' ``json_schema``)."""
    return {"type": "object", "additionalProperties": False, "required": ["score", "reason"],
            "properties": {"score": {"type": "number", "minimum": 0, "maximum": scale},
                           "reason": {"type": "string", "maxLength": REASON_MAX_CHARS}}}


class JudgeAttempt(Model):
    """One call to the judge: its raw answer (or none) and what went wrong, if anything."""

    raw: str | None = None
    error: str | None = None
    seconds: float


class Judgement(Model):
    """What the evaluation records of one judgement (``details.judge``)."""

    url: str
    model: str
    prompt_sha256: str = Field(description="sha256 of the request's messages as JSON (sorted keys).")
    prompt_chars: int
    truncated: list[str] = Field(default_factory=list, description="Which parts of the prompt were cut to fit.")
    attempts: list[JudgeAttempt] = Field(default_factory=list)
    raw: str | None = Field(default=None, description="The answer the score was parsed from (the last one).")
    score: float | None = None
    reason: str | None = None
    scale: float
    coefficient: float
    seconds: float = Field(description="Wall time of the whole judgement, every attempt included.")

    @property
    def parse_failures(self) -> int:
        """Attempts that got an answer that was not a valid JudgeAnswer."""
        return sum(1 for a in self.attempts if a.raw is not None and a.error is not None)
