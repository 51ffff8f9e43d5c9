"""opencode (npm ``opencode-ai``): OpenAI Chat Completions by default, or the Responses API.

Its global config (``$HOME/.config/opencode/opencode.json``, the XDG directories put under the session's
HOME) declares a ``rollwire`` provider on the session's OpenAI URL: npm ``@ai-sdk/openai-compatible``
(Chat Completions) or, with ``settings={"api": "responses"}``, ``@ai-sdk/openai`` (Responses, sent with
``store: false``). The session's model is both its model and its small model (the one it asks for the
session's title), so every call goes to the policy. Auto-update, sharing, the models.dev catalogue, LSP
downloads and default plugins are off. Headless: ``opencode run --format json`` (one JSON event a line).
See tests/harnesses/test_opencode.py (what 1.18.33 sends).
"""

from __future__ import annotations

import json

from producers.adapters.base import AdapterError, HarnessAdapter, HarnessContext, HarnessInvocation
from producers.adapters.common import base_url, check_settings, extra_args, extra_env
from producers.harness_install import ensure_harness

PROVIDER = "rollwire"
OPENCODE_SETTINGS = frozenset({"api"})
# The AI SDK provider package opencode loads for each API the proxy speaks.
PROVIDER_PACKAGES = {"chat": "@ai-sdk/openai-compatible", "responses": "@ai-sdk/openai"}


def opencode_config(ctx: HarnessContext, harness: str = "opencode") -> str:
    """opencode.json: the ``rollwire`` provider on the session, its one model as model and small model."""
    api = ctx.settings.get("api", "chat")
    package = PROVIDER_PACKAGES.get(api) if isinstance(api, str) else None
    if package is None:
        raise AdapterError(f"{harness}: agent.settings.api must be 'chat' or 'responses', not {api!r}")
    model = f"{PROVIDER}/{ctx.model}"
    return json.dumps({
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "model": model, "small_model": model,
        # Three identical tool calls in one reply make opencode ask for "doom_loop"; ``run`` has no one to
        # ask, rejects, and ends the session with exit 1. A looping policy is what RL must see; the
        # session's timeout bounds it.
        "permission": {"doom_loop": "allow"},
        "provider": {PROVIDER: {"npm": package, "name": PROVIDER,
                                "options": {"baseURL": base_url(ctx, "openai", harness), "apiKey": ctx.api_key},
                                "models": {ctx.model: {"name": ctx.model}}}},
    }, indent=2)


def opencode_env(home: str) -> dict[str, str]:
    """Every XDG directory under the session's HOME (opencode keeps config, data, cache and state there),
    and nothing fetched or shared."""
    home = home.rstrip("/")
    return {"XDG_CONFIG_HOME": f"{home}/.config", "XDG_DATA_HOME": f"{home}/.local/share",
            "XDG_CACHE_HOME": f"{home}/.cache", "XDG_STATE_HOME": f"{home}/.local/state",
            "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "NO_COLOR": "1"}


class OpencodeAdapter(HarnessAdapter):
    name = "opencode"

    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        check_settings(self.name, ctx.settings, OPENCODE_SETTINGS)
        config = opencode_config(ctx, self.name)
        env = {**opencode_env(ctx.home), **extra_env(ctx)}
        # The instruction on stdin, not as an argument: ``opencode run`` rebuilds its message from its
        # arguments as a shell line would read (an argument with a space is wrapped in double quotes, its
        # quotes escaped), so the model got the instruction quoted; what it reads from stdin (it does when
        # stdin is not a terminal) is taken as it is.
        argv = [self.executable(), "run", "--format", "json", "--log-level", "WARN", *extra_args(ctx)]
        return HarnessInvocation(argv=argv, env=env, home_files={".config/opencode/opencode.json": config},
                                 stdin=ctx.instruction)

    def executable(self) -> str:
        return str(ensure_harness(self.name))
