"""KL estimators between the policy and the reference model, per token.

Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), on the
sampled tokens with δ = logp - logp_ref (samples come from the policy):

- ``k1``: δ. Unbiased, can be negative; the default for KL in the reward.
- ``k2``: δ²/2. Biased, non-negative; its gradient matches k1's in expectation near δ = 0.
- ``k3``: exp(-δ) - 1 + δ. Unbiased, non-negative, low variance; GRPO's KL loss.

The host (``rlhf.algorithms.kl_divergence``) clamps the result to [-10, 10] and masks it, as the
registry contract says; these functions see raw log-probs. Half-precision inputs are computed
in float32 (float64 stays float64).

Deviation from OpenRLHF: k3 is clamped at 0 from below. For tiny δ, rounding in exp(-δ) - 1 + δ
can give a value like -1e-17 although the exact value is >= 0; elsewhere the results are equal.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch

from rlhf.api import as_float


def log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """δ = logp - logp_ref. (B, A)"""
    assert logprobs.shape == ref_logprobs.shape, (
        f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
    )
    return as_float(logprobs) - as_float(ref_logprobs)  # (B, A)


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = δ = logp - logp_ref (unbiased, may be negative). (B, A)"""
    return log_ratio(logprobs, ref_logprobs)  # (B, A)


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = δ²/2 (non-negative). (B, A)"""
    return log_ratio(logprobs, ref_logprobs).pow(2) / 2.0  # (B, A)


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-δ) - 1 + δ (unbiased and non-negative). (B, A)"""
    delta = log_ratio(logprobs, ref_logprobs)  # (B, A)
    return ((-delta).exp() - 1 + delta).clamp(min=0)  # (B, A); the clamp only undoes rounding
