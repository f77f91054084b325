"""The clipped value (critic) loss of PPO, per token.

Schulman et al. 2017 (arXiv:1707.06347) as implemented in OpenAI baselines' ``ppo2`` and in
OpenRLHF: the new value may move at most ``clip`` away from the value at rollout time, and the
larger of the clipped and unclipped squared errors is kept:

    V_clip = V_old + clamp(V - V_old, -c, c)
    L_V    = 0.5 · agg(max((V_clip - G)², (V - G)²))      (c = 0.5 by default; None: (V - G)²)

The host applies the 0.5 and the aggregation (``rlhf.algorithms.value_loss``).

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch


def clipped_value_error(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token max((V_clip - G)², (V - G)²) and where the clipped term is the larger one.

    values (B, A) with grad; old_values, returns (B, A). Returns ``(error (B, A), clipped (B, A) bool)``.
    """
    for name, tensor in (("old_values", old_values), ("returns", returns)):
        assert tensor.shape == values.shape, f"{name} {tuple(tensor.shape)} must match values {tuple(values.shape)}"
    unclipped = (values - returns).pow(2)  # (B, A)
    if clip is None:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    assert clip > 0, f"value clip must be positive (or None), got {clip}"
    values_clipped = old_values + (values - old_values).clamp(-clip, clip)  # (B, A)
    clipped = (values_clipped - returns).pow(2)  # (B, A)
    return torch.max(clipped, unclipped), (clipped > unclipped).detach()
