"""The generic ``command`` adapter: any command line, with the session filled in, so that a harness nobody
wrote an adapter for still runs unmodified.

The agent spec's ``command`` is a template with placeholders ``{base_url}`` (the session's OpenAI URL),
``{api_key}``, ``{model}``, ``{instruction}``, ``{session_id}``, ``{workspace}``, and also
``{anthropic_base_url}``, ``{gemini_base_url}`` and ``{home}``. The template is split into arguments with
``shlex.split`` first, and each placeholder is then replaced by its value inside the argument it stands
in: a value arrives whole, as (part of) one argument, whatever it holds (spaces, quotes, newlines), bare
(``--prompt {instruction}``), joined (``--prompt={instruction}``) or quoted (``"{instruction}"``) alike.
Substituting shell-quoted values and splitting afterwards would break as soon as a placeholder sits
inside quotes. No shell runs unless the template calls one; a script given to ``sh -c`` should read the
values from the environment (``"$ROLLWIRE_INSTRUCTION"``), where they need no quoting. Other braces (JSON
in a ``curl -d``) are left alone.

The environment carries the session too: ``OPENAI_BASE_URL``/``OPENAI_API_KEY``,
``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY`` and ``ROLLWIRE_*`` (base URLs, key, model, session id,
instruction, workspace). Settings: ``env`` (string → string) only.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from producers.adapters.base import AdapterError, HarnessAdapter, HarnessContext, HarnessInvocation
from producers.adapters.common import extra_env

PLACEHOLDERS = ("base_url", "api_key", "model", "instruction", "session_id", "workspace",
                "anthropic_base_url", "gemini_base_url", "home")
_PLACEHOLDER = re.compile(r"\{(%s)\}" % "|".join(PLACEHOLDERS))


def placeholder_values(ctx: HarnessContext) -> dict[str, str]:
    """Each placeholder's value for the session in ``ctx``."""
    urls = ctx.base_urls
    return {"base_url": urls.get("openai", ""), "api_key": ctx.api_key, "model": ctx.model,
            "instruction": ctx.instruction, "session_id": ctx.session_id, "workspace": ctx.workspace,
            "anthropic_base_url": urls.get("anthropic", ""), "gemini_base_url": urls.get("gemini", ""),
            "home": ctx.home}


def render_command(template: str, values: Mapping[str, str]) -> list[str]:
    """``template`` split into argv, then every placeholder replaced by its value within its argument."""
    try:
        tokens = shlex.split(template)
    except ValueError as exc:
        raise AdapterError(f"command: agent.command does not parse as a command line ({exc}): {template!r}") from exc
    if not tokens:
        raise AdapterError("command: agent.command is empty")
    return [_PLACEHOLDER.sub(lambda m: values[m.group(1)], token) for token in tokens]


def session_env(ctx: HarnessContext) -> dict[str, str]:
    """The session's URLs, key and model under the variables most SDKs read, and ``ROLLWIRE_*``."""
    values = placeholder_values(ctx)
    env = {"OPENAI_BASE_URL": values["base_url"], "OPENAI_API_KEY": ctx.api_key,
           "ANTHROPIC_BASE_URL": values["anthropic_base_url"], "ANTHROPIC_API_KEY": ctx.api_key,
           "ROLLWIRE_BASE_URL": values["base_url"], "ROLLWIRE_ANTHROPIC_BASE_URL": values["anthropic_base_url"],
           "ROLLWIRE_GEMINI_BASE_URL": values["gemini_base_url"], "ROLLWIRE_API_KEY": ctx.api_key,
           "ROLLWIRE_MODEL": ctx.model, "ROLLWIRE_SESSION_ID": ctx.session_id,
           "ROLLWIRE_INSTRUCTION": ctx.instruction, "ROLLWIRE_WORKSPACE": ctx.workspace}
    return {key: value for key, value in env.items() if value}


class CommandAdapter(HarnessAdapter):
    name = "command"

    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        unknown = sorted(set(ctx.settings) - {"env"})
        if unknown:
            raise AdapterError(f"command: unknown agent.settings {unknown}; known: ['env']")
        env_setting = ctx.settings.get("env", {})
        if not isinstance(env_setting, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env_setting.items()):
            raise AdapterError("command: agent.settings.env must map strings to strings")
        if not ctx.command:
            raise AdapterError("command: the command harness needs agent.command")
        argv = render_command(ctx.command, placeholder_values(ctx))
        return HarnessInvocation(argv=argv, env={**session_env(ctx), **extra_env(ctx)})
