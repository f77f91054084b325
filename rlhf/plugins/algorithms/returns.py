"""From sequence rewards to per-token advantages: reward placement, discounted returns, GAE and
batch whitening (docs/algorithms.md). Every built-in estimator uses these; they differ only in how they
shape the sequence reward first (``groups.py``) and in whether they whiten.

The order is OpenRLHF's (``experience_maker.compute_advantages_and_returns``):

1. clip the shaped sequence reward r̃ to [-c, c];
2. per-token reward R_t = -β·kl_t (only when KL is in the reward) + r̃ on the last action token;
3. returns G_t = m_t R_t + γ G_{t+1}, or GAE: δ_t = R_t + γ V_{t+1} - V_t, Â_t = δ_t + γλ Â_{t+1},
   returns = Â + V, with V = R = 0 at masked positions (so a chain runs through the holes of a
   multi-turn sample);
4. whitening over all action tokens of the rollout batch: Â ← (Â - μ) / sqrt(max(σ², 1e-8)).

GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation" (arXiv:1506.02438). REINFORCE++ whitening: Hu 2025 (arXiv:2501.03262).

Deviations from OpenRLHF:
1. Advantages and returns are set to 0 where the action mask is 0 (OpenRLHF leaves values there
   that the loss ignores). Action positions are unaffected.
2. ``sample_mask``: a sample marked invalid has an all-zero loss mask here (the action mask with
   its row zeroed), so it adds nothing to returns or whitening statistics and gets advantage and
   return 0.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import warnings

import torch

from rlhf.api import AdvantageConfig, AdvantageInputs, as_float, masked, masked_sum

WHITEN_MIN_VARIANCE = 1e-8


def loss_mask_of(inputs: AdvantageInputs) -> torch.Tensor:
    """The loss mask: the action mask with invalid samples' rows zeroed, as float of the rewards'
    dtype. (B, A)"""
    loss_mask = inputs.action_mask.bool()  # (B, A)
    if inputs.sample_mask is not None:
        assert inputs.sample_mask.shape == inputs.rewards.shape, (
            f"sample_mask {tuple(inputs.sample_mask.shape)} must match rewards {tuple(inputs.rewards.shape)}"
        )
        loss_mask = loss_mask & inputs.sample_mask.bool()[:, None]  # (B, A)
    return loss_mask.to(as_float(inputs.rewards).dtype)  # (B, A)


def last_action_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position where ``mask`` is 1 (A - 1 for an empty row). (B, 1)

    In a multi-turn sample this is the last token of the last model turn.
    """
    num_positions = mask.size(1)
    return num_positions - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)  # (B, 1)


def token_rewards(shaped_rewards: torch.Tensor, loss_mask: torch.Tensor, *, kl: torch.Tensor | None,
                  kl_coef: float, reward_clip: float | None) -> torch.Tensor:
    """R_t = -β·kl_t + [t = last action token]·clip(r̃, -c, c), and 0 where m_t = 0.

    shaped_rewards (B,), loss_mask (B, A) float, kl (B, A) or None. Returns (B, A).
    """
    assert shaped_rewards.dim() == 1 and loss_mask.dim() == 2 and shaped_rewards.size(0) == loss_mask.size(0), (
        f"rewards {tuple(shaped_rewards.shape)} and loss_mask {tuple(loss_mask.shape)} disagree on B"
    )
    r = shaped_rewards.to(loss_mask.dtype)  # (B,)
    if reward_clip is not None:
        r = r.clamp(min=-reward_clip, max=reward_clip)  # (B,)
    rewards = torch.zeros_like(loss_mask).scatter_(1, last_action_index(loss_mask), r[:, None])  # (B, A)
    if kl is not None and kl_coef > 0:
        assert kl.shape == loss_mask.shape, f"kl {tuple(kl.shape)} must match loss_mask {tuple(loss_mask.shape)}"
        rewards = rewards + (-kl_coef) * kl.to(loss_mask.dtype)  # (B, A)
    return masked(rewards, loss_mask)  # (B, A)


def discounted_returns(rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = m_t R_t + γ G_{t+1}, G_A = 0 (REINFORCE returns-to-go). rewards, loss_mask (B, A) -> (B, A)."""
    rewards = masked(rewards, loss_mask)  # (B, A)
    if gamma == 1.0 and bool(((rewards != 0).sum(dim=1) <= 1).all()):
        # An outcome reward without per-token KL: at most one nonzero term per row, so every sum is
        # exact in any order and a reverse cumulative sum equals the loop below bit for bit.
        return rewards.flip(1).cumsum(dim=1).flip(1)  # (B, A)
    returns = torch.zeros_like(rewards)  # (B, A)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    # A sequential loop, like OpenRLHF's, so sums are accumulated in the same order.
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] + gamma * running  # (B,)
        returns[:, t] = running
    return returns


def gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, *, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: δ_t = R_t + γV_{t+1} - V_t, Â_t = δ_t + γλÂ_{t+1}; returns = Â + V (V_A = 0).

    rewards, values, loss_mask (B, A). Masked positions carry V = R = 0. Returns
    ``(advantages (B, A), returns (B, A))`` before whitening.
    """
    assert values.shape == rewards.shape, f"values {tuple(values.shape)} must match rewards {tuple(rewards.shape)}"
    values = masked(values.to(rewards.dtype), loss_mask)  # (B, A)
    rewards = masked(rewards, loss_mask)  # (B, A)
    num_positions = rewards.size(1)
    advantages = torch.zeros_like(rewards)  # (B, A)
    last_advantage = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(num_positions)):
        next_values = values[:, t + 1] if t < num_positions - 1 else 0.0  # (B,)
        delta = rewards[:, t] + gamma * next_values - values[:, t]  # (B,)
        last_advantage = delta + gamma * lambd * last_advantage  # (B,)
        advantages[:, t] = last_advantage
    return advantages, advantages + values


def whiten(advantages: torch.Tensor, loss_mask: torch.Tensor, *, std_norm: bool = True) -> torch.Tensor:
    """Token-weighted whitening over every action token of the batch. (B, A) -> (B, A)

    μ = Σ Â m / Σ m, σ² = Σ (Â - μ)² m / Σ m, Â ← (Â - μ) / sqrt(max(σ², 1e-8));
    with ``std_norm=False`` only μ is subtracted. A batch without action tokens is returned as is.
    """
    num_tokens = loss_mask.bool().sum()
    if num_tokens == 0:
        return advantages
    mean = masked_sum(advantages, loss_mask) / num_tokens  # ()
    if not std_norm:
        return advantages - mean
    variance = masked_sum((advantages - mean).pow(2), loss_mask) / num_tokens  # ()
    return (advantages - mean) * variance.clamp(min=WHITEN_MIN_VARIANCE).rsqrt()  # (B, A)


def unit_gamma(estimator: str, config: AdvantageConfig) -> float:
    """γ for an estimator that compares samples of a group: always 1 (as in OpenRLHF).

    Returns-to-go of a group-shaped reward are only comparable across the group without
    discounting. Another γ is ignored with a warning, shown once per value.
    """
    if config.gamma != 1.0:
        warnings.warn(
            f"advantage estimator {estimator!r} compares the samples of a group and always uses "
            f"gamma = 1; gamma = {config.gamma} is ignored",
            UserWarning, stacklevel=3,
        )
    return 1.0


def returns_from_sequence_rewards(shaped_rewards: torch.Tensor, inputs: AdvantageInputs, config: AdvantageConfig,
                                  *, gamma: float, whiten_advantages: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The REINFORCE-family tail: clip, place on the last action token (+ KL), returns-to-go, and
    optionally whitening. shaped_rewards (B,). Returns ``(advantages (B, A), returns (B, A))``.

    ``advantages = returns = G`` before whitening; only the advantages are whitened.
    """
    loss_mask = loss_mask_of(inputs)  # (B, A)
    rewards = token_rewards(shaped_rewards, loss_mask, kl=inputs.kl, kl_coef=inputs.kl_coef,
                            reward_clip=config.reward_clip)  # (B, A)
    returns = discounted_returns(rewards, loss_mask, gamma)  # (B, A)
    advantages = whiten(returns, loss_mask, std_norm=config.std_norm) if whiten_advantages else returns  # (B, A)
    return masked(advantages, loss_mask), masked(returns, loss_mask)
