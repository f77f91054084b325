"""Statistics over the n samples of each prompt, the baselines of the group estimators.

The rollout batch holds the n samples of a prompt as contiguous rows, ``[p0s0 .. p0s(n-1), p1s0,
...]``, so a ``(B,)`` tensor viewed as ``(G, n)`` has one prompt per row. The std is the unbiased
(N - 1) one, as torch's and OpenRLHF's.

Samples marked invalid (``sample_mask`` False: failed samples under ``--on-failure mask``,
docs/outcomes.md) are left out: means, stds and leave-one-out means are taken over the k valid
samples of a group only, the unbiased versions (mean over k, std with k - 1, leave-one-out over
the other k - 1). A group with fewer than two valid samples has
no comparison to offer, so its samples get a shaped reward of 0 (std 0, leave-one-out baseline
equal to the sample itself). Invalid samples get 0 too.

Shape legend: ``B`` sequences, ``G`` prompts (groups), ``n`` samples per prompt (B = G·n).
"""

from __future__ import annotations

import torch

from rlhf.api import AdvantageInputs, as_float


def grouped(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards (G, n), valid (G, n) bool)``; invalid samples' rewards are replaced by 0."""
    rewards = as_float(inputs.rewards)  # (B,)
    n = inputs.group_size
    assert rewards.dim() == 1, f"rewards must be (B,), got {tuple(rewards.shape)}"
    assert n >= 1 and rewards.numel() % n == 0, f"batch of {rewards.numel()} samples is not a multiple of n = {n}"
    valid = torch.ones_like(rewards, dtype=torch.bool) if inputs.sample_mask is None else inputs.sample_mask.bool()  # (B,)
    rewards = torch.where(valid, rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device))  # (B,)
    return rewards.view(-1, n), valid.view(-1, n)  # (G, n), (G, n)


def ungrouped(shaped: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Back to one value per sample, 0 for invalid samples. (G, n) -> (B,)"""
    return torch.where(valid, shaped, torch.zeros((), dtype=shaped.dtype, device=shaped.device)).reshape(-1)  # (B,)


def group_count(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Number of valid samples per group. (G, 1)"""
    return valid.sum(dim=-1, keepdim=True).to(dtype)  # (G, 1)


def group_mean(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """mean_j r_j over the valid samples of each group. (G, n) -> (G, 1)"""
    count = group_count(valid, rewards.dtype)  # (G, 1)
    return rewards.sum(dim=-1, keepdim=True) / count.clamp(min=1)  # (G, 1); invalid rewards are 0


def group_std(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Unbiased std_j r_j over the valid samples of each group; 0 with fewer than two. (G, n) -> (G, 1)"""
    count = group_count(valid, rewards.dtype)  # (G, 1)
    deviations = torch.where(valid, rewards - group_mean(rewards, valid), torch.zeros_like(rewards))  # (G, n)
    std = (deviations.pow(2).sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (G, 1)
    if rewards.size(1) > 1:
        # Groups with every sample valid use torch's own std, bit for bit what OpenRLHF computes.
        full = valid.all(dim=-1, keepdim=True)  # (G, 1)
        std = torch.where(full, rewards.std(dim=-1, keepdim=True), std)  # (G, 1)
    return std


def leave_one_out_mean(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(Σ_j r_j - r_i) / (k - 1): the mean of the other valid samples of i's group. (G, n) -> (G, n)

    With fewer than two valid samples there are no others: the baseline is r_i itself.
    """
    count = group_count(valid, rewards.dtype)  # (G, 1)
    others = (rewards.sum(dim=-1, keepdim=True) - rewards) / (count - 1).clamp(min=1)  # (G, n)
    return torch.where(count > 1, others, rewards)  # (G, n)
