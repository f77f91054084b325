"""Per-token entropy of the policy's next-token distribution, for the optional entropy bonus.

H_t = -Σ_v p_v log p_v = logsumexp(z) - Σ_v softmax(z)_v z_v, computed in float32 from the logits
z. The trainer subtracts ``entropy_coef · agg(H)`` from the loss (OpenRLHF's sign).

Shape legend: ``B`` sequences, ``A`` action positions, ``V`` vocabulary.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - Σ softmax(z)·z over the vocabulary. logits (B, A, V) -> (B, A) float32."""
    logits = logits if logits.dtype == torch.float64 else logits.float()  # (B, A, V)
    probs = torch.softmax(logits, dim=-1)  # (B, A, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)  # (B, A)
