"""Which branch roles a sink keeps: the SFT store's and the trainer feed's role settings.

Every trace carries the role of its branch as the proxy recorded it: ``main`` (the agent's own loop),
``sub_agent`` (an agent it started) or ``side`` (title generation, summaries, memory extraction: calls
made *about* the task, not steps of it). A side call must not become an SFT row or a training sequence
carrying the task's reward, so by default the sinks keep ``main`` and ``sub_agent`` traces only; what they
leave out for its role is counted where each sink reports what it skipped.

Settings, in the style of the Kafka settings (``ROLLWIRE_*``), as comma-separated roles:
``ROLLWIRE_SFT_ROLES`` (the SFT store, ``rollwire export-sft --roles``) and ``ROLLWIRE_FEED_ROLES`` (the
trainer feed, ``ReadConfig(roles=...)`` of ``TrainerFeed``), each ``main,sub_agent`` by default.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import get_args

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.completions import BranchRole

ALL_ROLES: frozenset[str] = frozenset(get_args(BranchRole))
DEFAULT_ROLES: frozenset[str] = frozenset({"main", "sub_agent"})


def parse_roles(value: str | Iterable[str]) -> frozenset[str]:
    """Roles from a comma-separated text or an iterable of names; raises ValueError on an unknown or
    empty selection (keeping no role at all is a mistake, not a setting)."""
    names = value.split(",") if isinstance(value, str) else list(value)
    roles = frozenset(name.strip() for name in names if name.strip())
    unknown = sorted(roles - ALL_ROLES)
    if unknown:
        raise ValueError(f"unknown branch role(s) {', '.join(unknown)}; use {', '.join(sorted(ALL_ROLES))}")
    if not roles:
        raise ValueError(f"name at least one branch role ({', '.join(sorted(ALL_ROLES))})")
    return roles


def _text(roles: frozenset[str]) -> str:
    return ",".join(sorted(roles))


class SinkRoleSettings(BaseSettings):
    """The roles each sink keeps, read from ``ROLLWIRE_SFT_ROLES`` and ``ROLLWIRE_FEED_ROLES``."""

    model_config = SettingsConfigDict(env_prefix="ROLLWIRE_", extra="ignore")

    sft_roles: str = Field(default=_text(DEFAULT_ROLES), description=(
        "Branch roles whose traces the SFT store writes as rows (main, sub_agent, side: titles, routers, memory)."))
    feed_roles: str = Field(default=_text(DEFAULT_ROLES), description=(
        "Branch roles whose traces the trainer feed yields."))

    @field_validator("sft_roles", "feed_roles")
    @classmethod
    def _known_roles(cls, value: str) -> str:
        return _text(parse_roles(value))

    @property
    def sft(self) -> frozenset[str]:
        """Roles whose traces the SFT store writes as rows."""
        return parse_roles(self.sft_roles)

    @property
    def feed(self) -> frozenset[str]:
        """Roles whose traces the trainer feed batches."""
        return parse_roles(self.feed_roles)


def sft_roles_from_env() -> frozenset[str]:
    """The SFT store's roles: ``ROLLWIRE_SFT_ROLES``, else main and sub_agent."""
    return SinkRoleSettings().sft


def feed_roles_from_env() -> frozenset[str]:
    """The trainer feed's roles: ``ROLLWIRE_FEED_ROLES``, else main and sub_agent."""
    return SinkRoleSettings().feed
