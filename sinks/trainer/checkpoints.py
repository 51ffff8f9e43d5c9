"""The trainer's checkpoints: Hugging Face folders the engine reloads, written beside and renamed into
place, and the pruning that keeps the newest."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "policy-v"


def save_checkpoint(model: Any, out: Path, version: int, tokenizer: Any = None) -> Path:
    """The model as a Hugging Face folder ``out/policy-v{version}``: ``config.json`` (and the generation
    config), ``model.safetensors`` with every tensor of the state dict (the tokenizer's files when given),
    written to a hidden sibling first and renamed into place.

    Tied embeddings are stored twice, ``lm_head.weight`` beside ``model.embed_tokens.weight``:
    ``save_pretrained`` drops the tied copy, and vLLM's CPU build, reloading in place, would then keep
    its old output layer (the proxy refuses such a folder)."""
    from safetensors.torch import save_file

    folder = out / f"{CHECKPOINT_PREFIX}{version}"
    staging = out / f".{folder.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.config.save_pretrained(staging)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    # Clones: tensors that share storage (tied weights) cannot be saved as they are.
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def prune_checkpoints(out: Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest ``policy-v*`` folders (keep >= 1: the one serving stays)."""
    def version(path: Path) -> int:
        suffix = path.name[len(CHECKPOINT_PREFIX):]
        return int(suffix) if suffix.isdigit() else -1

    folders = sorted((p for p in out.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and version(p) >= 0), key=version)
    removed = folders[:-max(1, keep)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
