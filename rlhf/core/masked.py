"""Masked sums and means, shared by the algorithm plugins and the host's objectives.

Masks select with ``torch.where`` rather than multiply, so whatever sits at masked positions
(padding, prompt tokens, a NaN reward of a skipped sample) cannot leak into a result.

Imports torch: import this module only where tensors are used (``rlhf.core`` itself does not).

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch


def as_float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 when it already is: half precision is too coarse for these sums."""
    return x if x.dtype == torch.float64 else x.float()


def last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the column of each row's last real token of a (B, T) 0/1 mask, any padding side (T - 1
    for a row with none)."""
    mask = attention_mask.long()  # (B, T)
    return mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)  # (B,)


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is nonzero, 0 elsewhere (same shape as ``x``)."""
    assert mask.shape == x.shape, f"mask {tuple(mask.shape)} does not match tensor {tuple(x.shape)}"
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m over ``dim`` (all dims when None)."""
    selected = masked(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x·m / Σ m over ``dim`` (all dims when None); 0 where the mask is empty."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)
