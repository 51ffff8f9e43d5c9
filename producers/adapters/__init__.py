"""Harness adapters by name: ``adapter_for(agent.harness)`` for codex, claude-code, qwen-code, pi, gemini-cli,
opencode, command."""

from __future__ import annotations

from producers.adapters.base import AdapterError, HarnessAdapter
from producers.adapters.claude_code import ClaudeCodeAdapter
from producers.adapters.codex import CodexAdapter
from producers.adapters.command import CommandAdapter
from producers.adapters.gemini_cli import GeminiCliAdapter
from producers.adapters.opencode import OpencodeAdapter
from producers.adapters.pi import PiAdapter
from producers.adapters.qwen_code import QwenCodeAdapter

ADAPTERS: dict[str, type[HarnessAdapter]] = {
    adapter.name: adapter
    for adapter in (CodexAdapter, ClaudeCodeAdapter, QwenCodeAdapter, PiAdapter, GeminiCliAdapter, OpencodeAdapter,
                    CommandAdapter)
}


def adapter_for(name: str) -> HarnessAdapter:
    """The adapter for the agent spec's ``harness``; :class:`AdapterError` for an unknown one."""
    adapter = ADAPTERS.get(name)
    if adapter is None:
        raise AdapterError(f"unknown harness {name!r}; known: {', '.join(ADAPTERS)}")
    return adapter()


__all__ = ["ADAPTERS", "AdapterError", "HarnessAdapter", "adapter_for"]
