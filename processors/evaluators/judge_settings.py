"""The rubric judge's defaults, read from the environment (``ROLLWIRE_JUDGE_*``).

A task's ``judge`` evaluator settings override each of them for its sessions. The judge is any
OpenAI-compatible endpoint; by default the embedded engine, called directly: a judge's calls are not the
policy's, so they never go through a session's proxy and never appear on ``completions``.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class JudgeSettings(BaseSettings):
    """Every field reads ``ROLLWIRE_JUDGE_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_JUDGE_", extra="ignore", env_ignore_empty=True)

    url: str = Field(default="http://127.0.0.1:18000", description=(
        "The judge's OpenAI-compatible server (its base, without /v1): default the embedded engine, called "
        "directly, never through the proxy."))
    model: str = Field(default="rollwire-tiny", description="The model name the judge's requests ask for.")
    api_key: str | None = Field(default=None, description="Bearer token for the judge's server, if it needs one.")
    timeout_s: float = Field(default=60.0, gt=0, description="How long one judge call may take.")
    max_attempts: int = Field(default=3, ge=1, le=10, description=(
        "Calls per judgement: a call that fails or answers outside the structured form is retried up to "
        "this many calls in all; then the evaluation is status 'error' with the reason."))
    max_tokens: int = Field(default=256, ge=16, description="The judge's answer's token budget.")
    answer_chars: int = Field(default=4000, ge=100, description=(
        "How much of the session's final answer the judge sees (its end; a cut is marked)."))
    patch_chars: int = Field(default=12000, ge=100, description=(
        "How much of the session's patch the judge sees (its start; a cut is marked)."))
