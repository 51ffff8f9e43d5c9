"""Exact-token continuation on the real vLLM CPU build: every continued call's prompt extends its parent's
prompt + sampled ids, token for token, where a full re-render would not; and the drift is named.

A chat client plays the harness: it sends back what the proxy returned the way harnesses do (arguments as
the parser gave them, reasoning dropped, or the whole history under a template that strips reasoning).
Turns are forced by token ids (``rollwire_forced_tokens``) where a case needs a particular sample; the
unforced case samples the random model freely. Each case runs in ``exact`` and in ``rendered`` mode.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from schemas.completions import Completion
from schemas.transport import KafkaSettings
from tests.harnesses.common import ToolStep, forced_turn
from tests.proxy.conftest import ProxyUnderTest, auth, proxy_settings
from tests.servers import serve

pytestmark = pytest.mark.kafka

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.fixture
def proxy(kafka: KafkaSettings, vllm_url: str) -> Iterator[ProxyUnderTest]:
    with serve(create_app(proxy_settings(vllm_url, engine_timeout_s=300), kafka)) as url:
        yield ProxyUnderTest(url, kafka)


class ChatHarness:
    """A minimal chat harness: keeps the conversation and posts it for each turn."""

    def __init__(self, proxy: ProxyUnderTest, mode: str, **engine: Any) -> None:
        self.session = proxy.new_session(engine={"continuation": mode, "max_tokens": 24, "seed": 11} | engine)
        self.url = f"{self.session['base_urls']['openai']}/chat/completions"

    def ask(self, messages: list[dict[str, Any]], *, stream: bool = False, tools: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "agent-model", "messages": messages, "stream": stream}
        if tools:
            body["tools"] = TOOLS
        response = httpx.post(self.url, json=body, headers=auth(self.session), timeout=300)
        assert response.status_code == 200, response.text
        if not stream:
            return response.json()["choices"][0]["message"]
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    message["content"] += choice["delta"].get("content") or ""
        return message


def extends(child: Completion, parent: Completion) -> bool:
    """Whether the child's prompt starts with the parent's prompt + sampled ids."""
    whole = parent.prompt_token_ids.tolist() + parent.token_ids.tolist()
    return child.prompt_token_ids.tolist()[:len(whole)] == whole


def echo(message: dict[str, Any], *, reasoning: bool) -> dict[str, Any]:
    """The assistant turn as a harness sends it back: vLLM's parsed tool calls, and a leading <think> block
    either moved to ``reasoning_content`` (a harness that reads think tags) or dropped."""
    content = message.get("content")
    thought = None
    if content and content.lstrip().startswith("<think>") and "</think>" in content:
        head, _, content = content.partition("</think>")
        thought, content = head.split("<think>", 1)[1].strip(), content.strip()
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if reasoning and thought:
        out["reasoning_content"] = thought
    return out


async def test_unforced_multi_user_turn_session(proxy: ProxyUnderTest) -> None:
    """The random model samples freely; the client echoes its text back with each new user message."""
    for mode in ("exact", "rendered"):
        harness = ChatHarness(proxy, mode)
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
        for turn in range(4):
            reply = harness.ask(messages, stream=turn % 2 == 1, tools=False)
            messages += [echo(reply, reasoning=False), {"role": "user", "content": f"And then? ({turn})"}]
    events = await proxy.completions(8, timeout_s=60)
    by_session: dict[str, list[Completion]] = {}
    for event in events:
        by_session.setdefault(event.session_id, []).append(event)
    for calls in by_session.values():
        modes = {c.continuation.mode for c in calls[1:]}
        assert all(c.status == "ok" and c.continuation.branch == "b0" for c in calls)
        assert calls[0].continuation.opened == "first_call"
        assert [c.continuation.parent_sequence for c in calls] == [None, 0, 1, 2]
        if modes == {"exact"}:
            assert all(extends(child, parent) for parent, child in zip(calls, calls[1:]))
            assert all(c.continuation.drift is not None for c in calls[1:])
            for child in calls[1:]:  # the measured drift is what a re-render would have changed
                assert child.continuation.drift.rendered_prompt_tokens > 0
        else:
            assert modes == {"rendered"} and all(c.continuation.drift is None for c in calls)


async def test_tool_arguments_sampled_in_non_canonical_json(proxy: ProxyUnderTest) -> None:
    """The model writes ``{"command":"ls"}``; the parser and the harness give back ``{"command": "ls"}``."""
    compact = '<tool_call>\n{"name": "shell", "arguments": {"command":"ls"}}\n</tool_call>'
    for mode in ("exact", "rendered"):
        harness = ChatHarness(proxy, mode, turns=[forced_turn(compact), forced_turn("Done.")])
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
        reply = harness.ask(messages)
        assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
        messages += [echo(reply, reasoning=False),
                     {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "a.py\nb.py"}]
        assert harness.ask(messages)["content"] == "Done."
    exact, rendered = _pairs(await proxy.completions(4, timeout_s=60))
    assert extends(exact[1], exact[0]) and exact[1].continuation.mode == "exact"
    assert "tool_arguments_reserialized" in exact[1].continuation.drift.kinds
    assert not extends(rendered[1], rendered[0])  # a naive merge breaks here


async def test_chat_harness_that_does_not_send_reasoning_back(proxy: ProxyUnderTest) -> None:
    thought = "<think>\nThe user wants a greeting.\n</think>\n\nHello."
    for mode in ("exact", "rendered"):
        harness = ChatHarness(proxy, mode, turns=[forced_turn(thought), forced_turn("Bye.")])
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Greet me."}]
        reply = harness.ask(messages, tools=False)
        assert reply["content"] == thought  # no reasoning parser: the think block is in the text
        messages += [echo(reply, reasoning=False), {"role": "user", "content": "Now say bye."}]
        harness.ask(messages, tools=False)
    exact, rendered = _pairs(await proxy.completions(4, timeout_s=60))
    assert extends(exact[1], exact[0]) and exact[1].continuation.drift.kinds == ["reasoning_stripped"]
    assert not extends(rendered[1], rendered[0])


async def test_template_that_strips_earlier_reasoning(proxy: ProxyUnderTest) -> None:
    """The harness sends reasoning back, but the template drops it once a new user message arrives."""
    template = resources.files("deploy.engine").joinpath("chat_template_strip_reasoning.jinja").read_text()
    thought = "<think>\nCount the files first.\n</think>\n\nThere are two."
    for mode in ("exact", "rendered"):
        harness = ChatHarness(proxy, mode, extra={"chat_template": template},
                              turns=[forced_turn(thought), forced_turn("Three now.")])
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "How many files?"}]
        reply = harness.ask(messages, tools=False)
        messages += [echo(reply, reasoning=True), {"role": "user", "content": "And now?"}]
        harness.ask(messages, tools=False)
    exact, rendered = _pairs(await proxy.completions(4, timeout_s=60))
    assert extends(exact[1], exact[0]) and "reasoning_stripped" in exact[1].continuation.drift.kinds
    assert not extends(rendered[1], rendered[0])


async def test_parallel_tool_calls_and_a_compaction(proxy: ProxyUnderTest) -> None:
    """Two tool calls in one turn continue exactly; a compacted history then opens a new branch."""
    two = "\n".join(ToolStep("shell", {"command": c}).text() for c in ("ls", "pwd"))
    harness = ChatHarness(proxy, "exact", max_tokens=80, turns=[forced_turn(two), forced_turn("Both done.")])
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Look around."}]
    reply = harness.ask(messages)
    assert [c["function"]["name"] for c in reply["tool_calls"]] == ["shell", "shell"]
    messages += [echo(reply, reasoning=False)] + [
        {"role": "tool", "tool_call_id": c["id"], "content": out} for c, out in zip(reply["tool_calls"], ("a.py", "/w"))]
    harness.ask(messages, stream=True)
    harness.ask([SYSTEM, {"role": "user", "content": "Summary so far: two files in /w. Continue."}])
    first, second, compacted = await proxy.completions(3, timeout_s=60)
    assert extends(second, first) and second.continuation.mode == "exact"
    assert second.continuation.drift.differs is False  # canonical arguments: a re-render agrees here
    assert compacted.continuation.mode == "rendered" and compacted.continuation.opened == "history_differs"
    assert (first.continuation.branch, second.continuation.branch, compacted.continuation.branch) == ("b0", "b0", "b2")  # named after the call that opened it


async def test_retry_of_the_same_request_reuses_the_prompt(proxy: ProxyUnderTest) -> None:
    harness = ChatHarness(proxy, "exact", turns=[forced_turn("One."), forced_turn("Two.")])
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Count."}]
    reply = harness.ask(messages, tools=False)
    messages += [echo(reply, reasoning=False), {"role": "user", "content": "Next."}]
    harness.ask(messages, tools=False)
    harness.ask(messages, tools=False)  # asked again: same messages
    first, second, again = await proxy.completions(3, timeout_s=60)
    assert again.prompt_token_ids.tolist() == second.prompt_token_ids.tolist()
    assert again.continuation.retry_of_sequence == 1 and again.continuation.parent_sequence == 0
    assert extends(again, first)


def _pairs(events: list[Completion]) -> tuple[list[Completion], list[Completion]]:
    """The two sessions' calls, the exact-mode session first."""
    sessions: dict[str, list[Completion]] = {}
    for event in events:
        sessions.setdefault(event.session_id, []).append(event)
    [a, b] = sessions.values()
    return (a, b) if a[-1].continuation.mode == "exact" else (b, a)
