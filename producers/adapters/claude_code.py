"""Claude Code (``@anthropic-ai/claude-code``): the Anthropic Messages API, configured by environment.

``ANTHROPIC_BASE_URL`` is the session's Anthropic URL (no ``/v1``), the key goes in ``ANTHROPIC_API_KEY``;
every model slot (main, haiku/sonnet/opus defaults, subagents) is pinned to the session's model so that no
call asks for another; non-essential traffic, telemetry and the auto-updater are off; the per-request
attribution line is dropped from the system prompt (it varies and would break prefix merging).
Headless: ``claude -p … --output-format json --dangerously-skip-permissions`` (``IS_SANDBOX=1`` allows
that as root). See docs/harnesses.md.
"""

from __future__ import annotations

from producers.adapters.base import HarnessAdapter, HarnessContext, HarnessInvocation
from producers.adapters.common import base_url, check_settings, dashes_safe, extra_args, extra_env
from producers.harness_install import ensure_harness

MODEL_VARIABLES = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                   "ANTHROPIC_DEFAULT_OPUS_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")


class ClaudeCodeAdapter(HarnessAdapter):
    name = "claude-code"

    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        check_settings(self.name, ctx.settings)
        env = {"ANTHROPIC_BASE_URL": base_url(ctx, "anthropic", self.name), "ANTHROPIC_API_KEY": ctx.api_key,
               **{variable: ctx.model for variable in MODEL_VARIABLES},
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
               "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1", "IS_SANDBOX": "1",
               "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "NO_COLOR": "1", **extra_env(ctx)}
        argv = [self.executable(), "-p", "--output-format", "json", "--dangerously-skip-permissions",
                *extra_args(ctx), *dashes_safe(ctx.instruction)]
        return HarnessInvocation(argv=argv, env=env)

    def executable(self) -> str:
        return str(ensure_harness("claude-code"))
