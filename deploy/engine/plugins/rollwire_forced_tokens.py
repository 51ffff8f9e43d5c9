"""A vLLM logits processor that makes a request sample exactly the token ids it names.

Loaded by the embedded server (``--logits-processors rollwire_forced_tokens:ForcedTokensLogitsProcessor``,
this directory on ``PYTHONPATH``; see ``deploy/engine/server.py``). A request that carries

    "vllm_xargs": {"rollwire_forced_tokens": [151657, 198, 4913, ...]}   (or "151657,198,4913,...")

samples output token i as ids[i] (every other logit set to -inf), then the model's end-of-sequence id
(``SamplingParams.eos_token_id``, else the smallest stop id) until the request stops. Requests without
the field are untouched. This is how tests script a tiny random model's turns token for token: the ids
are what the chat template renders for the turn, special tokens such as ``<tool_call>`` and
``<|im_end|>`` included, so the next prompt extends the previous prompt plus these sampled ids (guided
decoding by a text regex cannot do that: it writes ``<tool_call>`` as ordinary text pieces).

Logprobs: with ``--logprobs-mode raw_logprobs`` the engine reports the model's own log-probability of
each forced token (computed before any logits processor); with ``processed_logprobs`` it reports the
forcing distribution's, 0.0. The forced token keeps its raw logit (``processed_logits`` shows it).

Runs in vLLM's environment only (torch, vllm); the project's environment must not import it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCED_TOKENS_ARG = "rollwire_forced_tokens"
RequestProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]  # (output ids so far, logits row)
_MAX_ID = 2**31 - 1

logger = logging.getLogger(__name__)


def forced_ids(params: SamplingParams) -> list[int] | None:
    """The ids a request's ``extra_args`` force, or None when it forces none.

    Raises ValueError (an HTTP 400 for the client) when the field is not a list of token ids or a
    comma-separated string of them."""
    extra: dict[str, Any] = params.extra_args or {}
    value = extra.get(FORCED_TOKENS_ARG)
    if value is None:
        return None
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",") if part.strip()]
        try:
            ids = [int(part) for part in parts]
        except ValueError as exc:
            raise ValueError(f"vllm_xargs.{FORCED_TOKENS_ARG} must be token ids separated by commas; "
                             f"got {value[:80]!r}") from exc
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = list(value)
    else:
        raise ValueError(f"vllm_xargs.{FORCED_TOKENS_ARG} must be a list of token ids or a comma-separated "
                         f"string of them; got {type(value).__name__}")
    if not ids:
        raise ValueError(f"vllm_xargs.{FORCED_TOKENS_ARG} is empty; give at least one token id")
    if bad := [i for i in ids if not 0 <= i <= _MAX_ID]:
        raise ValueError(f"vllm_xargs.{FORCED_TOKENS_ARG} holds ids that are not token ids: {bad[:5]}")
    return ids


def _end_id(params: SamplingParams) -> int | None:
    if params.eos_token_id is not None:
        return params.eos_token_id
    return min(params.all_stop_token_ids) if params.all_stop_token_ids else None


def _force(row: torch.Tensor, token: int) -> torch.Tensor:
    """``row`` with every logit but ``token``'s at -inf (``token`` keeps its own, or 0.0 if it had none)."""
    kept = row[token].clone()
    row.fill_(float("-inf"))
    row[token] = kept if torch.isfinite(kept) else 0.0
    return row


class ForcedTokensLogitsProcessor(AdapterLogitsProcessor):
    """Forces ``vllm_xargs.rollwire_forced_tokens`` token by token, then the end-of-sequence id."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.vocab_size: int = vllm_config.model_config.get_vocab_size()

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        forced_ids(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def new_req_logits_processor(self, params: SamplingParams) -> RequestProcessor | None:
        try:
            ids = forced_ids(params)
        except ValueError:  # validate_params refused it already; never fail inside the engine core
            return None
        if ids is None:
            return None
        end = _end_id(params)
        vocab = self.vocab_size
        if any(i >= vocab for i in ids):
            logger.warning("%s: ids beyond the vocabulary (%d) end the request there", FORCED_TOKENS_ARG, vocab)

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            position = len(output_ids)
            token = ids[position] if position < len(ids) else end
            if token is None:
                return logits
            if token >= logits.shape[-1]:
                if end is None or end >= logits.shape[-1]:
                    return logits
                token = end
            return _force(logits, token)

        return force
