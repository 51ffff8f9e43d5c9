"""Offline SFT with TRL's ``SFTTrainer`` on the SFT store's rows, the loss only on the model's own tokens.

    from sinks.bridges.trl_sft import rollwire_sft_trainer, sft_config
    trainer = rollwire_sft_trainer(model, tokenizer, Path("sft/sft.jsonl"), sft_config("out", max_steps=100))
    trainer.train()

The SFT store (sinks/sft.py) writes each accepted trace's ``token_ids`` and ``loss_mask`` beside its chat
messages. Training on the messages would have TRL re-render and re-tokenize the text, which need not give
the tokens the model sampled (a harness's template, tool-call rendering, whitespace), and TRL's
``assistant_only_loss`` trains on every assistant turn as the template marks it. The recipe instead hands
TRL a pre-tokenized dataset: ``input_ids`` are the trace's token ids and ``assistant_masks`` rollwire's
loss mask; TRL then skips tokenization and sets the labels to -100 wherever the mask is 0 (the prompt,
tool outputs, template glue), so the loss is the causal LM loss of the sampled tokens only. Rows longer
than ``max_length`` are cut by TRL (``truncation_mode="keep_start"``, the mask cut with them); rows with no
trained token (before or after the cut) are left out, counted in :class:`SftCounts`.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinks.trainer.torch_env import import_torch


@dataclass(slots=True)
class SftCounts:
    rows: int = 0
    rows_used: int = 0
    rows_without_trained_tokens: int = 0


def sft_records(path: Path, max_length: int | None = None, counts: SftCounts | None = None) -> list[dict[str, Any]]:
    """The store's rows (``sft.jsonl``) as pre-tokenized records: ``input_ids``, ``assistant_masks``, ``id``."""
    counts = counts if counts is not None else SftCounts()
    records = []
    with Path(path).open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            counts.rows += 1
            mask = [int(bit) for bit in row["loss_mask"]]
            if not any(mask[:max_length] if max_length else mask):
                counts.rows_without_trained_tokens += 1
                continue
            counts.rows_used += 1
            records.append({"input_ids": list(row["token_ids"]), "assistant_masks": mask, "id": str(row.get("id", ""))})
    return records


def sft_config(output_dir: str | Path, **overrides: Any) -> Any:
    """A ``trl.SFTConfig`` for pre-tokenized rows (no packing: each row keeps its own positions), float32 on
    CPU, nothing reported or saved by TRL; ``overrides`` are TRL's own settings."""
    torch = import_torch()
    from trl import SFTConfig

    settings: dict[str, Any] = {
        "output_dir": str(output_dir), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
        "packing": False, "bf16": False, "fp16": False, "use_cpu": not torch.cuda.is_available(),
        "report_to": "none", "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True,
        "truncation_mode": "keep_start", "completion_only_loss": None, "assistant_only_loss": False,
        "remove_unused_columns": True, "dataset_num_proc": None,
    }
    settings.update(overrides)
    return SFTConfig(**settings)


def rollwire_sft_trainer(model: Any, tokenizer: Any, rows: Path, args: Any,
                         counts: SftCounts | None = None) -> Any:
    """TRL's ``SFTTrainer`` over the SFT store file ``rows`` (see the module docstring)."""
    import_torch()
    from trl import SFTTrainer

    Dataset = importlib.import_module("datasets").Dataset
    records = sft_records(rows, args.max_length, counts)
    if not records:
        raise ValueError(f"{rows} has no row with a trained token")
    dataset = Dataset.from_list([{"input_ids": r["input_ids"], "assistant_masks": r["assistant_masks"]}
                                 for r in records])
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
