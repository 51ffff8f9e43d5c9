"""Google's Gemini CLI (``@google/gemini-cli``): the Gemini API, ``$HOME/.gemini/settings.json`` plus env.

settings.json chooses API-key auth (no interactive auth dialog) and turns off auto-update, usage
statistics, telemetry, the folder-trust prompt and loop detection. ``GOOGLE_GEMINI_BASE_URL`` is the session's root (the
Google SDK appends ``/v1beta/models/{model}:streamGenerateContent``) and ``GEMINI_API_KEY`` its key, sent
as ``x-goog-api-key``. The model is pinned with ``-m``, so the CLI makes no router call of its own.
Headless: ``gemini --yolo -o json --prompt=…``. See docs/harnesses.md and tests/harnesses/test_gemini_cli.py
(what 0.61.0 sends).
"""

from __future__ import annotations

import json

from producers.adapters.base import HarnessAdapter, HarnessContext, HarnessInvocation
from producers.adapters.common import base_url, check_settings, extra_args, extra_env
from producers.harness_install import ensure_harness


def gemini_settings() -> str:
    """settings.json: API-key auth, nothing phoning home, no folder-trust prompt, no loop detection."""
    return json.dumps({
        "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        # Its loop detector cuts the model's reply mid-stream (a hang-up: the call is not trainable) and
        # injects "Potential loop detected" as a user turn; a looping policy is what RL must see, and the
        # session's timeout bounds it. Qwen Code, its fork, ships with these heuristics off.
        "model": {"disableLoopDetection": True},
    }, indent=2)


class GeminiCliAdapter(HarnessAdapter):
    name = "gemini-cli"

    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        check_settings(self.name, ctx.settings)
        env = {"GOOGLE_GEMINI_BASE_URL": base_url(ctx, "gemini", self.name), "GEMINI_API_KEY": ctx.api_key,
               "NO_COLOR": "1", **extra_env(ctx)}
        # As --prompt=…: a value after "-p" that starts with a dash is read as an option; with "=" the whole
        # value is the prompt (the CLI is yargs-based, as Qwen Code, its fork).
        argv = [self.executable(), "--yolo", "-o", "json", "-m", ctx.model, *extra_args(ctx),
                f"--prompt={ctx.instruction}"]
        return HarnessInvocation(argv=argv, env=env, home_files={".gemini/settings.json": gemini_settings()})

    def executable(self) -> str:
        return str(ensure_harness(self.name))
