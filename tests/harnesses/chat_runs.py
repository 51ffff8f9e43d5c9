"""Running the Chat Completions CLIs (Qwen Code, Pi) headless on a proxy session, their model output
scripted by the session's ``engine.turns``: each CLI's configuration and script, and
``run_scripted_session``. Used by the multi-turn chat tests and by the fixture recorders under
``tests/fixtures/``.
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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses"
MODEL = "qwen3-coder"
INSTRUCTION = "Create notes.txt with the line alpha, then append the line beta, then say what you did."


# -- scripted model output ---------------------------------------------------------------------------

def qwen_script(workspace: Path) -> Script:
    # write_file wants an absolute path; run_shell_command runs in the project root (the cwd).
    return Script(steps=(ToolStep("write_file", {"file_path": str(workspace / "notes.txt"), "content": "alpha\n"}),
                         ToolStep("run_shell_command", {"command": "echo beta >> notes.txt",
                                                        "description": "Append beta to notes.txt"})),
                  answer="notes.txt now holds alpha and beta.", expected_files={"notes.txt": "alpha\nbeta\n"})


def pi_script(workspace: Path) -> Script:
    # Pi resolves relative paths against its cwd; its edit tool takes a list of exact replacements.
    return Script(steps=(ToolStep("bash", {"command": "printf 'alpha\\n' > notes.txt"}),
                         ToolStep("edit", {"path": "notes.txt",
                                           "edits": [{"oldText": "alpha", "newText": "alpha\nbeta"}]})),
                  answer="notes.txt now holds alpha and beta.", expected_files={"notes.txt": "alpha\nbeta\n"})


# -- the CLIs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatCli:
    """How to run one CLI headless against a proxy session: files it needs in HOME, command line, env."""

    name: str
    script: Callable[[Path], Script]
    configure: Callable[[Path, dict[str, Any]], tuple[list[str], dict[str, str]]]


def _configure_qwen(home: Path, session: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}}, "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False}, "general": {"enableAutoUpdate": False},
        "memory": {"enableManagedAutoMemory": False}, "model": {"name": MODEL}}))
    return ([str(ensure_harness("qwen-code")), "--yolo", "-o", "json", INSTRUCTION],
            {"OPENAI_BASE_URL": session["base_urls"]["openai"], "OPENAI_API_KEY": session["api_key"],
             "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"})


def _configure_pi(home: Path, session: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    # A reasoning model, unlike the text-only test's: Pi then sends its system prompt as a `developer`
    # message and adds `reasoning_effort`, so the fixtures cover that wire too.
    (home / ".pi" / "agent").mkdir(parents=True)
    (home / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"rollwire": {
        "baseUrl": session["base_urls"]["openai"], "api": "openai-completions", "apiKey": session["api_key"],
        "models": [{"id": MODEL, "reasoning": True, "contextWindow": 32768, "maxTokens": 4096}]}}}))
    return ([str(ensure_harness("pi")), "-p", "--provider", "rollwire", "--model", MODEL, "--no-session",
             INSTRUCTION], {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"})


QWEN = ChatCli("qwen-code", qwen_script, _configure_qwen)
PI = ChatCli("pi", pi_script, _configure_pi)


@dataclass
class ChatRun(SessionRun):
    """A chat CLI's scripted session: the CLI and its script with the run."""

    cli: ChatCli
    script: Script


async def run_scripted_session(proxy: ProxyUnderTest, cli: ChatCli, root: Path, *, max_tokens: int,
                               seed: int) -> ChatRun:
    """Run ``cli`` once in ``root/workspace`` (HOME ``root/home``) on a session scripted by its Script."""
    home, workspace = make_dirs(root)
    script = cli.script(workspace)
    session = proxy.new_session(engine={"max_tokens": max_tokens, "seed": seed, "turns": script.turns()})
    command, env = cli.configure(home, session)
    return await run_on_session(proxy, session, command, home=home, workspace=workspace,
                                env={**clean_env("PI_"), "HOME": str(home), **env}, run_type=ChatRun,
                                cli=cli, script=script)
