"""Correction weights for the mismatch between the rollout engine and the trainer.

The rollout engine (vLLM, or another kernel) samples with log-probs logp_rollout that differ
slightly from the trainer's recomputation logp_old of the same policy, so the samples are a little
off-policy. Each token's loss is multiplied by a detached importance weight built from
δ_roll = logp_old - logp_rollout:

- ``tis`` (truncated importance sampling; Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl):
  w = clamp(exp(δ_roll), lo, hi).
- ``icepop`` (token masking; IcePop, from inclusionAI's Ring-1T report, 2025):
  w = exp(δ_roll) when lo ≤ exp(δ_roll) ≤ hi, else 0.
- ``seq_mask_tis`` (sequence masking, OpenRLHF's ``seq-mask-tis``): a sequence whose geometric
  mean weight exp(Σ_t δ_roll m / Σ_t m) leaves [lo, hi] is dropped (w = 0 on all its tokens);
  the tokens of the others keep their own unclamped weight w = exp(δ_roll).

Defaults lo = 0.5, hi = 5.0 (OpenRLHF's).

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch

from rlhf.api import as_float, masked_mean
from rlhf.plugins.algorithms.ppo_config import CORRECTIONS


def correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, kind: str,
                       bounds: tuple[float, float],
                       action_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached weights ``w (B, A)`` and where the bounds acted ``outside (B, A) bool``.

    tis: w = clamp(exp(logp_old - logp_rollout), lo, hi);
    icepop: w = exp(logp_old - logp_rollout)·1[lo ≤ exp(·) ≤ hi];
    seq_mask_tis: w = exp(logp_old - logp_rollout)·1[lo ≤ exp(masked mean over the sequence) ≤ hi]
    (needs ``action_mask`` (B, A); ``outside`` marks every token of a dropped sequence).
    """
    assert kind in CORRECTIONS, f"unknown mismatch correction {kind!r}; choose one of {', '.join(CORRECTIONS)}"
    assert old_logprobs.shape == rollout_logprobs.shape, (
        f"old_logprobs {tuple(old_logprobs.shape)} and rollout_logprobs {tuple(rollout_logprobs.shape)} differ"
    )
    low, high = bounds
    ratio = (as_float(old_logprobs) - as_float(rollout_logprobs)).detach().exp()  # (B, A)
    outside = (ratio < low) | (ratio > high)  # (B, A)
    if kind == "seq_mask_tis":
        assert action_mask is not None, "seq_mask_tis needs the action mask"
        log_ratio = as_float(old_logprobs) - as_float(rollout_logprobs)  # (B, A)
        sequence_ratio = masked_mean(log_ratio, action_mask, dim=-1).exp()  # (B,) geometric mean
        dropped = (sequence_ratio < low) | (sequence_ratio > high)  # (B,)
        outside = dropped[:, None].expand_as(ratio)  # (B, A)
        return torch.where(outside, torch.zeros_like(ratio), ratio).detach(), outside
    if kind == "tis":
        weights = ratio.clamp(min=low, max=high)  # (B, A)
    else:
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)  # (B, A)
    return weights, outside
