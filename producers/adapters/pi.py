"""Pi (``@mariozechner/pi-coding-agent``): OpenAI Chat Completions by default, or its Gemini provider.

``$HOME/.pi/agent/models.json`` declares a ``rollwire`` provider on the session: ``api`` is
``openai-completions`` on the session's OpenAI URL, or with ``settings={"api": "gemini"}``
``google-generative-ai`` on the session's Gemini URL plus ``/v1beta`` (the Google SDK appends
``/models/{id}:streamGenerateContent`` once Pi clears its API version). The model is pinned (``--model``
with ``--provider rollwire``); offline mode, version check and telemetry are off. Headless:
``pi -p --no-session``. Settings: ``api`` (``openai`` | ``gemini``), ``reasoning`` (bool: the model is a
reasoning model, so Pi sends a ``developer`` system message and ``reasoning_effort``), ``context_window``
and ``max_tokens`` (ints, Pi's model limits). See docs/harnesses.md.
"""

from __future__ import annotations

import json
from typing import Any

from producers.adapters.base import AdapterError, HarnessAdapter, HarnessContext, HarnessInvocation
from producers.adapters.common import base_url, check_settings, extra_args, extra_env
from producers.harness_install import ensure_harness

PROVIDER = "rollwire"
PI_SETTINGS = frozenset({"api", "reasoning", "context_window", "max_tokens"})


def pi_models(ctx: HarnessContext, harness: str = "pi") -> str:
    """models.json: the ``rollwire`` provider on the session's chat (or Gemini) URL, one model."""
    api = ctx.settings.get("api", "openai")
    if api == "openai":
        provider: dict[str, Any] = {"baseUrl": base_url(ctx, "openai", harness), "api": "openai-completions"}
    elif api == "gemini":
        provider = {"baseUrl": f"{base_url(ctx, 'gemini', harness)}/v1beta", "api": "google-generative-ai"}
    else:
        raise AdapterError(f"{harness}: agent.settings.api must be 'openai' or 'gemini', not {api!r}")
    reasoning = ctx.settings.get("reasoning", False)
    window = ctx.settings.get("context_window", 32768)
    max_tokens = ctx.settings.get("max_tokens", 4096)
    if not isinstance(reasoning, bool):
        raise AdapterError(f"{harness}: agent.settings.reasoning must be true or false")
    for key, value in (("context_window", window), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AdapterError(f"{harness}: agent.settings.{key} must be a positive integer")
    provider |= {"apiKey": ctx.api_key, "models": [
        {"id": ctx.model, "reasoning": reasoning, "contextWindow": window, "maxTokens": max_tokens}]}
    return json.dumps({"providers": {PROVIDER: provider}}, indent=2)


def pi_message(instruction: str) -> str:
    """Pi has no ``--``: an argument starting with ``-`` is an option and one with ``@`` a file to attach,
    so such an instruction gets a leading space to arrive as the message."""
    return f" {instruction}" if instruction.startswith(("-", "@")) else instruction


class PiAdapter(HarnessAdapter):
    name = "pi"

    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        check_settings(self.name, ctx.settings, PI_SETTINGS)
        models = pi_models(ctx, self.name)
        env = {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0", "NO_COLOR": "1",
               **extra_env(ctx)}
        argv = [self.executable(), "-p", "--provider", PROVIDER, "--model", ctx.model, "--no-session",
                *extra_args(ctx), pi_message(ctx.instruction)]
        return HarnessInvocation(argv=argv, env=env, home_files={".pi/agent/models.json": models})

    def executable(self) -> str:
        return str(ensure_harness("pi"))
