"""Qwen Code (``@qwen-code/qwen-code``): OpenAI Chat Completions, ``$HOME/.qwen/settings.json`` plus env.

settings.json selects OpenAI auth and the session's model, and turns off usage statistics (an Aliyun
host), telemetry, auto-update and the managed auto-memory (a background request after every turn).
``OPENAI_BASE_URL``/``OPENAI_API_KEY`` point it at the session. Headless: ``qwen --yolo -o json --prompt=…``.
See docs/harnesses.md.
"""

from __future__ import annotations

import json

from producers.adapters.base import HarnessAdapter, HarnessContext, HarnessInvocation
from producers.adapters.common import base_url, check_settings, extra_args, extra_env
from producers.harness_install import ensure_harness


def qwen_settings(model: str) -> str:
    """settings.json: OpenAI auth, the model pinned, nothing phoning home, no background memory calls."""
    return json.dumps({
        "security": {"auth": {"selectedType": "openai"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False},
        "memory": {"enableManagedAutoMemory": False},
        # Its loop heuristics (off by default in 0.24) would cut a reply mid-stream; stated so an upgrade
        # that turns them on changes nothing.
        "model": {"name": model, "skipLoopDetection": True},
    }, indent=2)


class QwenCodeAdapter(HarnessAdapter):
    name = "qwen-code"

    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        check_settings(self.name, ctx.settings)
        env = {"OPENAI_BASE_URL": base_url(ctx, "openai", self.name), "OPENAI_API_KEY": ctx.api_key,
               "OPENAI_MODEL": ctx.model, "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1", "NO_COLOR": "1",
               **extra_env(ctx)}
        # As --prompt=…: a positional prompt (or "-p PROMPT") that starts with a dash is read as options,
        # and Qwen Code takes nothing after "--". With "=" the whole value is the prompt.
        argv = [self.executable(), "--yolo", "-o", "json", *extra_args(ctx), f"--prompt={ctx.instruction}"]
        return HarnessInvocation(argv=argv, env=env, home_files={".qwen/settings.json": qwen_settings(ctx.model)})

    def executable(self) -> str:
        return str(ensure_harness("qwen-code"))
