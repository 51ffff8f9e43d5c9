"""Running the real Claude Code CLI headless on a proxy session, its model output scripted by the session's
``engine.turns``: the scripts, the isolated environment, and ``run_claude``. Used by the Claude Code
tests and by ``tests/fixtures/harnesses/claude-code/record_claude_code.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.harness_install import ensure_harness
from tests.harnesses.common import Script, SessionRun, ToolStep, clean_env, make_dirs, run_on_session
from tests.proxy.conftest import ProxyUnderTest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "claude-code"
MODEL = "claude-sonnet-4-5"
INSTRUCTION = "Create notes.txt with the line alpha, then append the line beta, then say what you did."
ANSWER = "notes.txt now holds alpha and beta."


# -- scripted model output ---------------------------------------------------------------------------

def tool_script(workspace: Path) -> Script:
    # Write wants an absolute path; Bash runs in the workspace (the cwd).
    return Script(steps=(ToolStep("Write", {"file_path": str(workspace / "notes.txt"), "content": "alpha\n"}),
                         ToolStep("Bash", {"command": "echo beta >> notes.txt",
                                           "description": "Append beta to notes.txt"})),
                  answer=ANSWER, expected_files={"notes.txt": "alpha\nbeta\n"})


def text_script(workspace: Path) -> Script:
    return Script(steps=(), answer="Hello from rollwire.", expected_files={})


# -- running Claude Code -----------------------------------------------------------------------------

def claude_env(session: dict[str, Any], home: Path) -> dict[str, str]:
    """The environment of a headless, isolated Claude Code on a proxy session (see HARNESSES.md)."""
    return {**clean_env("CLAUDE"), "HOME": str(home), "ANTHROPIC_BASE_URL": session["base_urls"]["anthropic"],
            "ANTHROPIC_API_KEY": session["api_key"], "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "CLAUDE_CODE_SUBAGENT_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1"}


@dataclass
class ClaudeRun(SessionRun):
    """A Claude Code session: its script with the run, and the result line of its JSON output."""

    script: Script

    def result(self) -> dict[str, Any]:
        return json.loads(self.stdout.strip().splitlines()[-1])


async def run_claude(proxy: ProxyUnderTest, root: Path, script_for: Callable[[Path], Script], *, max_tokens: int,
                     seed: int, instruction: str = INSTRUCTION) -> ClaudeRun:
    """Run Claude Code once in ``root/workspace`` (HOME ``root/home``) on a session scripted by ``script_for``."""
    home, workspace = make_dirs(root)
    script = script_for(workspace)
    session = proxy.new_session(engine={"max_tokens": max_tokens, "seed": seed, "turns": script.turns()})
    command = [str(ensure_harness("claude-code")), "-p", instruction, "--output-format", "json",
               "--dangerously-skip-permissions"]
    return await run_on_session(proxy, session, command, home=home, workspace=workspace,
                                env=claude_env(session, home), run_type=ClaudeRun, script=script)
