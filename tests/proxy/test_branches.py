"""Message equivalence and branch placement, in process: which call continues which branch, and why not."""

from __future__ import annotations

import numpy as np

from proxy.continuation.branches import MAX_BRANCHES, BranchStore
from proxy.continuation.equivalence import same_arguments, same_message
from schemas.completions import ChatMessage, NormalizedRequest, SamplingParams, ToolCall, ToolDefinition
from schemas.prompt_chain import ChainLink

SYSTEM = ChatMessage(role="system", content="You are a coding agent.")
USER = ChatMessage(role="user", content="fix the test")
TOOLS = [ToolDefinition(name="shell", parameters={"type": "object", "properties": {"command": {"type": "string"}}})]


def call(name: str = "shell", arguments: str = '{"command":"ls"}', call_id: str = "c1") -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


def served(*calls: ToolCall, content: str | None = None, reasoning: str | None = None) -> ChatMessage:
    return ChatMessage(role="assistant", content=content, reasoning=reasoning, tool_calls=list(calls))


def request(*messages: ChatMessage, tools: list[ToolDefinition] | None = None, **extra: object) -> NormalizedRequest:
    return NormalizedRequest(messages=list(messages), tools=TOOLS if tools is None else tools,
                             sampling=SamplingParams(extra=dict(extra)))


def record(store: BranchStore, req: NormalizedRequest, sequence: int, reply: ChatMessage,
           prompt_len: int = 10, sampled: int = 4) -> None:
    placement = store.place(req)
    branch = placement.branch if placement.kind != "open" else store.open(placement, req, sequence)
    prompt = list(range(prompt_len))
    store.record(branch, req, sequence, prompt, list(range(100, 100 + sampled)), reply, "stop", closed=True,
                 retry=placement.kind == "retry")


def test_arguments_are_equal_as_json_values() -> None:
    assert same_arguments('{"a":1,"b":[true]}', '{"b": [true], "a": 1}')
    assert not same_arguments('{"a":1}', '{"a": 2}')
    assert same_arguments("apply this patch", " apply this patch ")  # freeform text: stripped equality
    assert not same_arguments("{not json", "{not  json")


def test_assistant_turn_equivalence_ignores_ids_reasoning_and_dropped_text() -> None:
    mine = served(call(arguments='{"command":"ls"}', call_id="call_0"), content="Let me look.", reasoning="hmm")
    assert same_message(mine, served(call(arguments='{"command": "ls"}', call_id="toolu_9"), content="Let me look."))
    assert same_message(mine, served(call(call_id="x"), content=None))  # text dropped, calls kept
    assert not same_message(mine, served(call(name="bash"), content="Let me look."))
    assert not same_message(mine, served(call(), call(call_id="c2"), content="Let me look."))
    text_only = served(content="The answer is 4.")
    assert same_message(text_only, served(content="The answer is 4.\n"))
    assert not same_message(text_only, served(content=None))  # a text turn's text is what was said


def test_developer_is_system_and_tool_ids_are_ignored() -> None:
    assert same_message(SYSTEM, ChatMessage(role="developer", content="You are a coding agent."))
    assert same_message(ChatMessage(role="tool", tool_call_id="a", content="ok"),
                        ChatMessage(role="tool", tool_call_id="b", content="ok"))
    assert not same_message(ChatMessage(role="tool", content="ok"), ChatMessage(role="tool", content="fail"))


def test_tool_results_continue_the_branch() -> None:
    store = BranchStore()
    first = request(SYSTEM, USER)
    assert store.place(first).opened == "first_call"
    record(store, first, 0, served(call()))
    result = ChatMessage(role="tool", tool_call_id="renamed", content="a.py")
    second = request(SYSTEM, USER, served(call(arguments='{"command": "ls"}', call_id="renamed")), result)
    placement = store.place(second)
    assert placement.kind == "continue" and placement.branch is not None and placement.branch.branch_id == "b0"
    assert placement.new_messages == [result]


def test_retry_rewinds_and_a_fork_opens_a_new_branch() -> None:
    store = BranchStore()
    first = request(SYSTEM, USER)
    record(store, first, 0, served(call()))
    second = request(SYSTEM, USER, served(call()), ChatMessage(role="tool", content="a.py"))
    record(store, second, 1, served(content="done"))
    again = store.place(second)
    assert again.kind == "retry" and again.branch is not None and again.branch.last_sequence == 1
    forked = store.place(request(SYSTEM, USER, served(call()), ChatMessage(role="tool", content="b.py")))
    assert forked.kind == "open" and forked.opened == "fork"


def test_rewritten_history_and_other_tools_open_new_branches() -> None:
    store = BranchStore()
    first = request(SYSTEM, USER)
    record(store, first, 0, served(call()))
    compacted = request(SYSTEM, ChatMessage(role="user", content="Summary of the work so far: ..."))
    assert store.place(compacted).opened == "history_differs"
    assert store.place(compacted).role == "main"
    other_tools = request(SYSTEM, USER, served(call()), ChatMessage(role="tool", content="x"),
                          tools=[*TOOLS, ToolDefinition(name="read")])
    assert store.place(other_tools).opened == "tools_differ"
    injected = request(SYSTEM, USER, served(call()), ChatMessage(role="tool", content="x"),
                       served(content="an answer the model never gave"), ChatMessage(role="user", content="go on"))
    assert store.place(injected).opened == "assistant_in_new_messages"


def test_roles_side_calls_and_sub_agents() -> None:
    store = BranchStore()
    record(store, request(SYSTEM, USER), 0, served(call()))
    title = request(ChatMessage(role="system", content="Write a 5-word title."), USER, tools=[])
    assert store.place(title).role == "side"
    router = request(SYSTEM, USER, response_format={"type": "json_object"})  # same history, structured
    placement = store.place(router, router)
    assert placement.kind == "open" and placement.role == "side"
    explorer = request(ChatMessage(role="system", content="You are a file search specialist."), USER)
    assert store.place(explorer).role == "sub_agent"


def test_first_structured_call_is_side_not_main() -> None:
    store = BranchStore()
    router = request(USER, tools=[], response_format={"type": "json_schema"})
    assert store.place(router, router).role == "side"


def test_a_branch_evicted_while_its_call_is_in_flight_is_recorded_and_continued() -> None:
    store = BranchStore()
    first = request(SYSTEM, USER)
    placement = store.place(first)
    in_flight = store.open(placement, first, 0)
    for i in range(MAX_BRANCHES):  # concurrent calls with other histories open branches meanwhile
        other = request(SYSTEM, ChatMessage(role="user", content=f"other task {i}"))
        store.open(store.place(other), other, i + 1)
    assert len(store) == MAX_BRANCHES
    store.record(in_flight, first, 0, list(range(10)), [100, 101], served(call()), "tool_calls", closed=True,
                 retry=False)
    assert len(store) == MAX_BRANCHES
    follow_up = request(SYSTEM, USER, served(call()), ChatMessage(role="tool", content="ok", tool_call_id="c1"))
    placement = store.place(follow_up)
    assert placement.kind == "continue" and placement.branch is in_flight


def test_a_tool_changed_in_place_is_other_tools() -> None:
    """The store reuses the last signature while the tools compare equal: a parameter changed deep inside
    one tool (same names, same count) must still be other tools."""
    store = BranchStore()
    record(store, request(SYSTEM, USER), 0, served(call()))
    follow_up = [SYSTEM, USER, served(call()), ChatMessage(role="tool", content="x")]
    assert store.place(request(*follow_up)).kind == "continue"
    changed = [ToolDefinition(name="shell", parameters={"type": "object",
                                                        "properties": {"command": {"type": "integer"}}})]
    assert store.place(request(*follow_up, tools=changed)).opened == "tools_differ"
    assert store.place(request(*follow_up)).kind == "continue"  # and back


def test_a_branch_keeps_its_tokens_packed_and_exact() -> None:
    store = BranchStore()
    req = request(SYSTEM, USER)
    placement = store.place(req)
    branch = store.open(placement, req, 0)
    prompt, sampled = [0, 7, 2**31 - 1, 151_643], [9, 151_645]
    store.record(branch, req, 0, prompt, sampled, served(call()), "stop", closed=True, retry=False)
    assert branch.tokens.dtype == np.int32 and not branch.tokens.flags.writeable
    assert branch.tokens.tolist() == prompt + sampled
    assert branch.last_prompt == prompt and branch.prompt_length == len(prompt)
    # With the recorded event's link, its tokens are the branch's (the same array, not a copy).
    link_tokens = np.array(prompt + sampled, dtype=np.int32)
    link = ChainLink("e1", "s", 0, link_tokens, (), [], 0, len(link_tokens))
    store.record(branch, req, 1, prompt, sampled, served(call()), "stop", closed=True, retry=True, link=link)
    assert branch.tokens is link_tokens and branch.last_prompt == prompt


def test_a_title_call_before_the_agent_does_not_make_it_a_sub_agent() -> None:
    # opencode asks for the session's title (no tools, its own system prompt) before the agent's first call.
    store = BranchStore()
    title = request(ChatMessage(role="system", content="You are a title generator."), USER, tools=[])
    assert store.place(title).role == "main"  # nothing tells it from a tool-less harness's first call
    record(store, title, 0, served(content="A title"))
    agent = request(SYSTEM, USER)
    assert store.place(agent).role == "main"
    record(store, agent, 1, served(call()))
    explorer = request(ChatMessage(role="system", content="You are a file search specialist."), USER)
    assert store.place(explorer).role == "sub_agent"  # judged against the agent's line, not the title's
    assert store.place(request(ChatMessage(role="system", content="Summarize."), USER, tools=[])).role == "side"
