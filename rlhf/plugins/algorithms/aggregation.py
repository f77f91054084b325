"""Loss aggregations: how a per-token loss ℓ (B, A) becomes the scalar that is differentiated.

Every aggregation returns one micro-batch's share of the optimizer step's loss, normalised by
counts over the whole step (``LossNorm``: all micro-batches and data-parallel ranks), so the sum
of the shares is the step loss and the gradient does not depend on how the step is split:

- ``token_mean`` (default): Σ_{i,t} ℓ m / N_tokens. Every action token weighs the same (DAPO,
  arXiv:2503.14476; OpenRLHF since 2026-06).
- ``seq_mean_token_mean``: Σ_i (Σ_t ℓ m / Σ_t m) / N_seq. Every sequence weighs the same, tokens
  within it equally (the GRPO paper's form).
- ``seq_mean_token_sum``: Σ_i Σ_t ℓ m / N_seq. Long sequences weigh more.
- ``seq_mean_token_sum_norm``: Σ_i (Σ_t ℓ m / L_max) / N_seq, L_max = max new tokens: a
  constant per-token weight, free of length bias (Dr. GRPO, arXiv:2503.20783).

N_seq counts sequences with at least one action token; sequences without any contribute 0.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf.api import LossNorm, RlhfError, masked_sum


def _at_least_one(count: Any) -> Any:
    """A step normaliser that is never 0 (a step without action tokens has a zero numerator)."""
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def token_mean(loss: torch.Tensor, action_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_{i,t} ℓ_{i,t} m_{i,t} / N_tokens (N over the whole optimizer step). loss, action_mask (B, A) -> ()"""
    return masked_sum(loss, action_mask) / _at_least_one(norm.num_tokens)


def seq_mean_token_mean(loss: torch.Tensor, action_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_i (Σ_t ℓ_{i,t} m_{i,t} / Σ_t m_{i,t}) / N_seq. loss, action_mask (B, A) -> ()"""
    tokens_per_sequence = action_mask.bool().sum(dim=-1).clamp(min=1).to(loss.dtype)  # (B,)
    per_sequence = masked_sum(loss, action_mask, dim=-1) / tokens_per_sequence  # (B,)
    return per_sequence.sum() / _at_least_one(norm.num_sequences)


def seq_mean_token_sum(loss: torch.Tensor, action_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_i Σ_t ℓ_{i,t} m_{i,t} / N_seq. loss, action_mask (B, A) -> ()"""
    return masked_sum(loss, action_mask) / _at_least_one(norm.num_sequences)


def seq_mean_token_sum_norm(loss: torch.Tensor, action_mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """Σ_i (Σ_t ℓ_{i,t} m_{i,t} / L_max) / N_seq, L_max = max new tokens (Dr. GRPO). loss, action_mask (B, A) -> ()"""
    if norm.max_new_tokens is None or norm.max_new_tokens <= 0:
        raise RlhfError(
            "loss aggregation 'seq_mean_token_sum_norm' divides by the generation budget: pass "
            f"max_new_tokens (a positive number of tokens), got {norm.max_new_tokens!r}"
        )
    per_sequence = masked_sum(loss, action_mask, dim=-1) / norm.max_new_tokens  # (B,)
    return per_sequence.sum() / _at_least_one(norm.num_sequences)
