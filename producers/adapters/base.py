"""The harness adapter contract: how one CLI is configured and started, headless, against a session.

An adapter knows one harness (its config files, environment, command line, how it is installed) and
nothing about where it runs: it turns a :class:`HarnessContext` into a :class:`HarnessInvocation`, which
the gateway node hands to a runtime. The session's base URLs and API key come from the proxy's session
API (``schemas.api.SessionCreated``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from producers.errors import AdapterError as AdapterError


@dataclass(frozen=True, slots=True)
class HarnessContext:
    """Everything an adapter may use to configure its harness for one session."""

    session_id: str
    instruction: str
    model: str
    api_key: str
    base_urls: Mapping[str, str]
    """Per provider API as the harness reaches it: ``openai`` ({proxy}/s/{id}/v1), ``anthropic`` and
    ``gemini`` ({proxy}/s/{id})."""
    home: str
    workspace: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The agent spec's settings (adapter-specific; unknown keys are an error)."""
    command: str | None = None
    """The agent spec's command template (the generic ``command`` adapter only)."""


@dataclass(frozen=True, slots=True)
class HarnessInvocation:
    """What to run: the command line, its environment, and files to write under HOME first."""

    argv: list[str]
    env: dict[str, str]
    home_files: dict[str, str] = field(default_factory=dict)
    stdin: str | None = None
    """Text for the harness's standard input (None: none; a CLI that reads its input when stdin is not a
    terminal gets an empty one)."""


class HarnessAdapter(abc.ABC):
    """One harness."""

    name: str
    """The agent spec's ``harness`` value."""

    @abc.abstractmethod
    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        """The headless run of this harness on the session in ``ctx``."""

    def executable(self) -> str | None:
        """The harness binary on this machine, installing it (pinned) if needed; None for ``command``."""
        return None
