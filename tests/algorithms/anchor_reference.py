"""CISPO and SAPO as the anchors compute them, transcribed as math into float64 (no code copied),
with hand-derived gradients instead of autograd, so a disagreement with ours is a real one.

Followed, read at these commits:

- verl (github.com/volcengine/verl, commit b178a3cd56f58b2d502255daba591e92833930a7, 2026-01-29),
  ``verl/trainer/ppo/core_algos.py``: ``compute_policy_loss_cispo``, ``compute_policy_loss_sapo``
  (their per-token losses, multiplied by ``rollout_is_weights`` when given) and ``agg_loss``
  (``token-mean``, ``seq-mean-token-mean``).
- TRL (github.com/huggingface/trl, commit f2cd57710ae345ea6428ae95363267fcf38a3dc8, version
  1.10.0.dev0), ``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss`` with
  ``loss_type="cispo"`` and ``"sapo"`` (token-level importance sampling, beta 0).

Every tensor is float64 ``(B, A)``; ``mask`` is 0/1. Each function returns the per-token loss (0 off
the mask) and its gradient with respect to ``logprobs`` (the derivative of Σ loss · mask).
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # verl clamps log(π/π_old) to [-20, 20] before exp; TRL does not


def _ratio(logprobs, old_logprobs, clamp: bool):
    """(ratio, d ratio / d logprobs): the clamp's derivative is 0 outside [-20, 20]."""
    log_ratio = logprobs - old_logprobs
    if not clamp:
        ratio = torch.exp(log_ratio)
        return ratio, ratio
    inside = (log_ratio >= -LOG_RATIO_CLAMP) & (log_ratio <= LOG_RATIO_CLAMP)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return ratio, torch.where(inside, ratio, torch.zeros_like(ratio))


def verl_cispo(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, weights=None):
    """verl: L = -sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) · A · logprob (· w).
    The weight is gradient-stopped, so dL/dlogprob = -clamp(r) · A (· w)."""
    ratio, _ = _ratio(logprobs, old_logprobs, clamp=True)
    weight = torch.minimum(torch.maximum(ratio, torch.full_like(ratio, 1 - clip_low)),
                           torch.full_like(ratio, 1 + clip_high))
    w = torch.ones_like(ratio) if weights is None else weights
    loss = -weight * advantages * logprobs * w
    grad = -weight * advantages * w
    return loss * mask, grad * mask


def trl_cispo(logprobs, old_logprobs, advantages, mask, *, epsilon_high):
    """TRL: L = -sg(min(r, epsilon_high)) · A · logprob, r = exp(logprob - old) unclamped; epsilon_high
    is the ratio bound itself (ScaleRL's ε_max)."""
    ratio, _ = _ratio(logprobs, old_logprobs, clamp=False)
    weight = torch.minimum(ratio, torch.full_like(ratio, epsilon_high))
    return -weight * advantages * logprobs * mask, -weight * advantages * mask


def _sapo(ratio, d_ratio, advantages, tau_pos, tau_neg):
    """-σ(τ(r - 1)) · 4/τ · A, τ = τ_pos where A > 0 else τ_neg; derivative by the chain rule:
    d/dr σ(τ(r-1)) · 4/τ = τ σ (1 - σ) · 4/τ = 4 σ (1 - σ)."""
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    sigma = 1.0 / (1.0 + torch.exp(-tau * (ratio - 1.0)))
    loss = -sigma * (4.0 / tau) * advantages
    grad = -4.0 * sigma * (1.0 - sigma) * d_ratio * advantages
    return loss, grad


def verl_sapo(logprobs, old_logprobs, advantages, mask, *, tau_pos, tau_neg, weights=None):
    """verl: the gate of the clamped ratio (· rollout_is_weights when given)."""
    ratio, d_ratio = _ratio(logprobs, old_logprobs, clamp=True)
    loss, grad = _sapo(ratio, d_ratio, advantages, tau_pos, tau_neg)
    w = torch.ones_like(ratio) if weights is None else weights
    return loss * w * mask, grad * w * mask


def trl_sapo(logprobs, old_logprobs, advantages, mask, *, tau_pos, tau_neg):
    """TRL: the gate of the unclamped ratio (``sapo_temperature_pos`` / ``_neg``)."""
    ratio, d_ratio = _ratio(logprobs, old_logprobs, clamp=False)
    loss, grad = _sapo(ratio, d_ratio, advantages, tau_pos, tau_neg)
    return loss * mask, grad * mask


def verl_token_mean(loss, grad, mask):
    """verl's ``token-mean`` (one data-parallel rank, the batch is the step): Σ L m / Σ m, and its
    gradient per token."""
    tokens = mask.sum()
    return (loss * mask).sum() / tokens, grad * mask / tokens


def verl_seq_mean_token_mean(loss, grad, mask):
    """verl's ``seq-mean-token-mean``: mean over sequences with at least one token of Σ_t L m /
    (Σ_t m + 1e-8)."""
    per_row_tokens = mask.sum(dim=-1, keepdim=True)
    rows = (per_row_tokens > 0).to(loss.dtype).sum()
    value = ((loss * mask).sum(dim=-1, keepdim=True) / (per_row_tokens + 1e-8)).sum() / rows
    return value, grad * mask / (per_row_tokens + 1e-8) / rows


def trl_sequence_mean(loss, grad, mask):
    """TRL's ``grpo`` / ``sapo`` reduction: the mean over all rows of Σ_t L m / max(Σ_t m, 1)."""
    per_row_tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    rows = loss.shape[0]
    return ((loss * mask).sum(dim=-1, keepdim=True) / per_row_tokens).sum() / rows, grad * mask / per_row_tokens / rows
