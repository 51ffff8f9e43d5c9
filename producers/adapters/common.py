"""What the CLI adapters share: settings checks, the ``extra_args``/``env`` settings, base URLs, TOML strings."""

from __future__ import annotations

import json
from collections.abc import Mapping, Set
from typing import Any

from producers.adapters.base import AdapterError, HarnessContext

COMMON_SETTINGS: frozenset[str] = frozenset({"extra_args", "env"})
"""Settings every CLI adapter takes: ``extra_args`` (list of strings, appended to the command line before
the instruction) and ``env`` (string → string, added to the harness's environment)."""


def check_settings(harness: str, settings: Mapping[str, Any], known: Set[str] = frozenset()) -> None:
    """Refuse settings this adapter does not know, and ill-typed common ones."""
    allowed = COMMON_SETTINGS | known
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise AdapterError(f"{harness}: unknown agent.settings {unknown}; known: {sorted(allowed)}")
    extra = settings.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise AdapterError(f"{harness}: agent.settings.extra_args must be a list of strings")
    env = settings.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise AdapterError(f"{harness}: agent.settings.env must map strings to strings")


def extra_args(ctx: HarnessContext) -> list[str]:
    return list(ctx.settings.get("extra_args", []))


def extra_env(ctx: HarnessContext) -> dict[str, str]:
    return dict(ctx.settings.get("env", {}))


def base_url(ctx: HarnessContext, api: str, harness: str) -> str:
    """The session's base URL for ``api`` (``openai``, ``anthropic``, ``gemini``)."""
    url = ctx.base_urls.get(api)
    if not url:
        raise AdapterError(f"{harness}: the session has no {api!r} base URL (has {sorted(ctx.base_urls)})")
    return url.rstrip("/")


def toml_string(value: str) -> str:
    """``value`` as a TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value, ensure_ascii=False)


def dashes_safe(instruction: str) -> list[str]:
    """The instruction as the last arguments of a command line: after ``--`` so that a leading dash is text."""
    return ["--", instruction]
