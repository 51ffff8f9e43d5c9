"""Running the real Codex CLI (``codex exec``) on a proxy session through a custom Responses provider, its
model output scripted by the session's ``engine.turns``: the config.toml, ``run_codex`` and the tool
scripts. Used by the Codex tests and by the fixture recorders under ``tests/fixtures/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from producers.harness_install import ensure_harness
from tests.harnesses.common import Script, SessionRun, ToolStep, clean_env, make_dirs, run_on_session
from tests.proxy.conftest import ProxyUnderTest

# A name outside Codex's model catalog: it offers exec_command, a namespace and web_search.
PLAIN_MODEL = "qwen3-coder"
# A catalog name: Codex adds its freeform apply_patch tool (custom, with a Lark grammar).
CATALOG_MODEL = "gpt-5.5"
PROOF = "codex-proof.txt"
PROOF_TEXT = "rollwire codex ok\n"


def codex_config(session: dict[str, Any], model: str) -> str:
    """config.toml for a custom provider on the session: Responses wire, no retries, nothing phoning home."""
    return f"""model = "{model}"
model_provider = "rollwire"
approval_policy = "never"
sandbox_mode = "danger-full-access"

[model_providers.rollwire]
name = "rollwire"
base_url = "{session['base_urls']['openai']}"
env_key = "ROLLWIRE_CODEX_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[features]
plugins = false
"""


async def run_codex(proxy: ProxyUnderTest, root: Path, instruction: str, engine: dict[str, Any],
                    model: str = PLAIN_MODEL) -> SessionRun:
    """Run ``codex exec`` once in ``root/workspace`` (HOME ``root/home``) on a new session with ``engine``."""
    home, workspace = make_dirs(root)
    (home / "codex").mkdir()
    session = proxy.new_session(engine=engine)
    (home / "codex" / "config.toml").write_text(codex_config(session, model))
    env = {**clean_env("CODEX_"), "HOME": str(home), "CODEX_HOME": str(home / "codex"),
           "ROLLWIRE_CODEX_KEY": session["api_key"], "NO_COLOR": "1"}
    command = [str(ensure_harness("codex")), "exec", "--skip-git-repo-check", "--color", "never", instruction]
    return await run_on_session(proxy, session, command, home=home, workspace=workspace, env=env, timeout_s=600)


def scripted(script: Script, max_tokens: int, seed: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "seed": seed, "turns": script.turns()}


def shell_script() -> Script:
    command = f"printf 'rollwire codex ok\\n' > {PROOF}"
    return Script(steps=(ToolStep("exec_command", {"cmd": command}),), answer="Wrote the proof file.",
                  expected_files={PROOF: PROOF_TEXT})


def patch_script() -> Script:
    patch = f"*** Begin Patch\n*** Add File: {PROOF}\n+rollwire codex ok\n*** End Patch\n"
    return Script(steps=(ToolStep("apply_patch", {"input": patch}),), answer="Patched in the proof file.",
                  expected_files={PROOF: PROOF_TEXT})
