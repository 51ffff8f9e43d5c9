"""The GRPO loss and one update on a batch: token log-probabilities at the trained positions, the clipped
surrogate with truncated importance sampling (the package docstring gives the formula)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sinks.errors import TrainerError
from sinks.trainer.torch_env import import_torch


@dataclass(frozen=True)
class LossParts:
    """The loss and what it says about the batch (tensors; call ``float`` on them)."""

    loss: Any
    mean_ratio: Any
    """Mean over trained tokens of exp(logp_old - logp_rollout): 1 when the sampler is the trainer's policy."""
    truncated: Any
    """Share of trained tokens whose importance weight was capped at ``is_cap``."""


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any, position_ids: Any, loss_mask: Any,
                   temperature: float = 1.0) -> Any:
    """Log-probability of each token given the ones before it under ``logits / temperature``; computed only
    where ``loss_mask`` is 1 (0 elsewhere), so the vocabulary-wide logits exist for trained tokens only."""
    torch = import_torch()
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids).last_hidden_state
    targets = loss_mask[:, 1:].bool()          # token t is predicted at position t - 1
    logits = model.get_output_embeddings()(hidden[:, :-1][targets]).float() / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:][targets][:, None]).squeeze(-1)
    out = torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device)
    shifted = torch.zeros_like(loss_mask, dtype=torch.bool)
    shifted[:, 1:] = targets
    return out.masked_scatter(shifted, picked)


def importance_weights(old_logprobs: Any, rollout_logprobs: Any, loss_mask: Any) -> Any:
    """Untruncated importance weights ``exp(logp_old - logp_rollout)`` of the sampler's tokens: 1 where
    ``loss_mask`` is 0 (no ratio is formed there; the loss multiplies by the mask)."""
    torch = import_torch()
    return torch.exp((old_logprobs.detach() - rollout_logprobs) * loss_mask.float())


def truncated_importance_weights(old_logprobs: Any, rollout_logprobs: Any, loss_mask: Any,
                                 is_cap: float = 2.0) -> Any:
    """The loss's truncated importance sampling weights, ``min(exp(logp_old - logp_rollout), is_cap)``
    (verl's token-level TIS, ``rollout_is: token`` with ``rollout_is_threshold`` = ``is_cap``)."""
    torch = import_torch()
    return torch.clamp(importance_weights(old_logprobs, rollout_logprobs, loss_mask), max=is_cap)


def grpo_loss(new_logprobs: Any, old_logprobs: Any, rollout_logprobs: Any, advantages: Any, loss_mask: Any,
              clip_eps: float = 0.2, is_cap: float = 2.0) -> LossParts:
    """Token-level clipped surrogate with truncated importance sampling (the module docstring's formula),
    masked mean over trained tokens. ``old_logprobs`` carry no gradient (the policy before this batch)."""
    torch = import_torch()
    mask = loss_mask.float()
    old = old_logprobs.detach()
    ratio = torch.exp((new_logprobs - old) * mask)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    behaviour = importance_weights(old, rollout_logprobs, loss_mask)
    weight = truncated_importance_weights(old, rollout_logprobs, loss_mask, is_cap)
    tokens = mask.sum().clamp(min=1)
    loss = -(weight * surrogate * mask).sum() / tokens
    truncated = ((behaviour > is_cap).float() * mask).sum() / tokens
    return LossParts(loss=loss, mean_ratio=(behaviour * mask).sum() / tokens, truncated=truncated)


@dataclass(frozen=True)
class UpdateStats:
    """One batch's optimizer step(s)."""

    loss: float
    mean_ratio: float
    truncated: float
    grad_norm: float
    trained_tokens: int


def grpo_update(model: Any, optimizer: Any, batch: Any, *, temperature: float = 1.0, clip_eps: float = 0.2,
                is_cap: float = 2.0, epochs: int = 1, max_grad_norm: float = 1.0) -> UpdateStats:
    """``epochs`` optimizer steps of :func:`grpo_loss` on one padded batch of torch tensors; the figures
    are the first update's (the on-policy one)."""
    torch = import_torch()
    if batch.packed:
        raise TrainerError("the reference trainer takes padded batches (TrainerFeed(pack=False))")
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.loss_mask)
    with torch.no_grad():
        old = token_logprobs(model, *args, temperature=temperature)
    first: UpdateStats | None = None
    for _ in range(max(1, epochs)):
        new = token_logprobs(model, *args, temperature=temperature)
        parts = grpo_loss(new, old, batch.logprobs, batch.advantages, batch.loss_mask, clip_eps, is_cap)
        optimizer.zero_grad()
        parts.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if first is None:
            first = UpdateStats(loss=float(parts.loss.detach()), mean_ratio=float(parts.mean_ratio),
                                truncated=float(parts.truncated), grad_norm=float(grad_norm),
                                trained_tokens=int(batch.loss_mask.sum()))
    assert first is not None
    return first
