"""vLLM's initial weight version ``default`` is the policy's version 0 wherever a completion names it: the
spans generate returns are recorded numbered, so a fresh engine's exact calls build without problems."""

from __future__ import annotations

from processors.builders.common import completion_versions
from proxy.policy import numbered_spans, sampled_version
from schemas.completions import Completion, NormalizedRequest


def _completion(spans: list[dict[str, object]] | None, policy_version: str | None = "0") -> Completion:
    return Completion(session_id="s", sequence=0, api="openai.chat", request=NormalizedRequest(messages=[]),
                      policy_version=policy_version, weight_versions=spans)


def test_the_initial_version_is_recorded_as_zero() -> None:
    raw = [{"start": 0, "end": 5, "version": "default"}, {"start": 5, "end": 9, "version": "3"}]
    spans = numbered_spans(raw)
    assert spans == [{"start": 0, "end": 5, "version": "0"}, {"start": 5, "end": 9, "version": "3"}]
    assert sampled_version(spans) == "0"
    problems: list[str] = []
    assert completion_versions(_completion(spans), problems) == [0, 0, 3] and problems == []


def test_spans_without_a_version_are_kept_as_they_came() -> None:
    assert numbered_spans(None) is None
    odd = [{"start": 0, "end": 2}, "not a span"]
    assert numbered_spans(odd) == odd  # type: ignore[arg-type]


def test_a_raw_default_span_is_still_a_problem_for_the_builder() -> None:
    """What numbering prevents: the builder names an unnumbered span and leaves it out of the range."""
    problems: list[str] = []
    assert completion_versions(_completion([{"start": 0, "end": 5, "version": "default"}]), problems) == [0]
    assert problems and "has no version number" in problems[0]
