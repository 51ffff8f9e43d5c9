"""Realistic coding-harness Chat Completions requests (30–50 KB): a long system prompt, a dozen tool
definitions, and a conversation of tool calls with file contents and command output as results."""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path
from typing import Any

_TOOL_NAMES = ("shell", "read_file", "write_file", "edit", "glob", "grep", "list_dir", "web_fetch",
               "todo_write", "task", "notebook_edit", "ask_user")


def _source_snippets() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))[:80]]


def harness_request(rng: random.Random, target_bytes: int, snippets: list[str], *, stream: bool = True) -> dict[str, Any]:
    """One request body of about ``target_bytes`` once JSON-encoded."""
    tools = [{"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ').capitalize()}. " + "Use it carefully. " * 12,
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Absolute path."},
            "command": {"type": "string", "description": "The command line to run."},
            "timeout": {"type": "integer", "minimum": 1}}, "required": ["path"]}}} for name in _TOOL_NAMES]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in a repository. " * 60},
        {"role": "user", "content": [{"type": "text", "text": "Fix the failing test in tests/test_core.py."}]},
    ]
    turn = 0
    while len(json.dumps({"messages": messages, "tools": tools})) < target_bytes:
        call_id = f"call_{turn}"
        tool = rng.choice(_TOOL_NAMES)
        messages.append({"role": "assistant", "content": None, "reasoning_content": "Let me look at that.",
                         "tool_calls": [{"id": call_id, "type": "function", "function": {
                             "name": tool, "arguments": json.dumps({"path": f"/repo/src/mod{turn}.py"})}}]})
        snippet = rng.choice(snippets)
        start = rng.randrange(0, max(1, len(snippet) - 4000))
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": snippet[start:start + rng.randrange(1500, 4000)]})
        turn += 1
    return {"model": "qwen3-coder", "messages": messages, "tools": tools, "stream": stream,
            "stream_options": {"include_usage": True}, "max_tokens": 256, "temperature": 1.0}


def harness_requests(count: int, seed: int = 0, low: int = 30_000, high: int = 50_000) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    snippets = _source_snippets()
    return [harness_request(rng, rng.randrange(low, high), snippets) for _ in range(count)]
