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

Defaults lo = 0.5, hi = 5.0 (OpenRLHF's). OpenRLHF's third mode, ``seq-mask-tis``, is not here.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch

from rlhf.core.masked import as_float
from rlhf.plugins.algorithms.ppo_config import CORRECTIONS



def correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, kind: str,
                       bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached weights ``w (B, A)`` and where the bounds acted ``outside (B, A) bool``.

    tis: w = clamp(exp(logp_old - logp_rollout), lo, hi);
    icepop: w = exp(logp_old - logp_rollout)·1[lo ≤ exp(·) ≤ hi].
    """
    assert kind in CORRECTIONS, f"unknown mismatch correction {kind!r}; choose one of {', '.join(CORRECTIONS)}"
    assert old_logprobs.shape == rollout_logprobs.shape, (
        f"old_logprobs {tuple(old_logprobs.shape)} and rollout_logprobs {tuple(rollout_logprobs.shape)} differ"
    )
    low, high = bounds
    ratio = (as_float(old_logprobs) - as_float(rollout_logprobs)).detach().exp()  # (B, A)
    outside = (ratio < low) | (ratio > high)  # (B, A)
    if kind == "tis":
        weights = ratio.clamp(min=low, max=high)  # (B, A)
    else:
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)  # (B, A)
    return weights, outside
