"""Codex CLI (``@openai/codex``): the OpenAI Responses API through a custom provider in ``config.toml``.

Codex ignores ``OPENAI_BASE_URL``; ``$CODEX_HOME/config.toml`` (here ``$HOME/.codex``) names a provider
whose ``base_url`` is the session's OpenAI URL and whose key comes from ``ROLLWIRE_CODEX_KEY``, with
retries off, approvals off (``never`` + full access: the runtime is the sandbox), analytics and plugins
off (they phone home). Headless: ``codex exec --skip-git-repo-check``. See docs/harnesses.md.
"""

from __future__ import annotations

from producers.adapters.base import HarnessAdapter, HarnessContext, HarnessInvocation
from producers.adapters.common import (
    base_url, check_settings, dashes_safe, extra_args, extra_env, toml_string,
)
from producers.harness_install import ensure_harness

KEY_VARIABLE = "ROLLWIRE_CODEX_KEY"


def codex_config(model: str, openai_base_url: str) -> str:
    """config.toml: a ``rollwire`` provider on the session, Responses wire, no retries, nothing phoning home."""
    return f"""model = {toml_string(model)}
model_provider = "rollwire"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.rollwire]
name = "rollwire"
base_url = {toml_string(openai_base_url)}
env_key = "{KEY_VARIABLE}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[features]
plugins = false
"""


class CodexAdapter(HarnessAdapter):
    name = "codex"

    def invocation(self, ctx: HarnessContext) -> HarnessInvocation:
        check_settings(self.name, ctx.settings)
        config = codex_config(ctx.model, base_url(ctx, "openai", self.name))
        env = {"CODEX_HOME": f"{ctx.home}/.codex", KEY_VARIABLE: ctx.api_key, "NO_COLOR": "1",
               **extra_env(ctx)}
        argv = [self.executable(), "exec", "--skip-git-repo-check", "--color", "never", *extra_args(ctx),
                *dashes_safe(ctx.instruction)]
        return HarnessInvocation(argv=argv, env=env, home_files={".codex/config.toml": config})

    def executable(self) -> str:
        return str(ensure_harness("codex"))
