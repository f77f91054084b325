"""The PPO clipped surrogate policy loss, per token.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347), eq. 7:

    ρ_t = exp(clamp(logp_t - logp_old_t, -20, 20))
    ℓ_t = -min(ρ_t Â_t, clip(ρ_t, 1 - ε_low, 1 + ε_high) Â_t)

with the refinements OpenRLHF applies:

1. separate lower and upper clip ranges ("clip-higher", DAPO, arXiv:2503.14476): ε_high > ε_low
   lets unlikely tokens grow;
2. dual clip (Ye et al. 2020, arXiv:1912.09729), c > 1: for Â_t < 0, ℓ_t = -max(min(...), c Â_t),
   which bounds the loss when ρ is very large;
3. the log-ratio is clamped to ±20 before exp so a stale token cannot overflow;
4. optionally each ℓ_t is multiplied by a detached rollout/trainer mismatch weight (``tis``,
   ``icepop`` or ``seq_mask_tis``, see ``mismatch.py``), which needs the rollout engine's log-probs.

The loss is returned per token (0 where the action mask is 0); the host aggregates it with the
run's loss aggregation. Metrics (detached scalars): ``policy/clip_frac`` (share of action tokens
where the clipped term is the smaller one), ``policy/approx_kl`` (mean of logp_old - logp, the
k1 estimate of KL(old ‖ new)), ``policy/dual_clip_frac`` with dual clip, and with rollout
log-probs ``policy/mismatch_kl`` (mean of logp_rollout - logp_old) plus, with a correction,
``policy/correction_weight_mean`` and ``policy/correction_clip_frac``.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch

from rlhf.api import PolicyLossInputs, RlhfError, masked, masked_mean
from rlhf.plugins.algorithms.mismatch import correction_weights
from rlhf.plugins.algorithms.ppo_config import PPOLossConfig

__all__ = ["LOG_RATIO_CLAMP", "PPOLossConfig", "ppo_policy_loss"]

LOG_RATIO_CLAMP = 20.0


def ppo_policy_loss(inputs: PolicyLossInputs,
                    config: PPOLossConfig | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO: ℓ_t = -min(ρ_t Â_t, clip(ρ_t, 1 - ε_low, 1 + ε_high) Â_t), ρ_t = exp(clamp(logp - logp_old, ±20)).

    Dual clip c: for Â_t < 0, ℓ_t = -max(min(...), c Â_t). Mismatch correction: ℓ_t ← w_t ℓ_t.
    inputs.logprobs (B, A) with grad; old_logprobs, advantages, action_mask, rollout_logprobs
    (B, A). Returns ``(per_token_loss (B, A), metrics)``.
    """
    config = config or PPOLossConfig()
    logprobs, old_logprobs, advantages = inputs.logprobs, inputs.old_logprobs, inputs.advantages
    action_mask = inputs.action_mask
    for name, tensor in (("old_logprobs", old_logprobs), ("advantages", advantages), ("action_mask", action_mask)):
        assert tensor.shape == logprobs.shape, f"{name} {tuple(tensor.shape)} must match logprobs {tuple(logprobs.shape)}"

    raw_log_ratio = logprobs - old_logprobs  # (B, A)
    ratio = raw_log_ratio.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP).exp()  # (B, A)
    surrogate = ratio * advantages  # (B, A)
    clipped_surrogate = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages  # (B, A)
    objective = torch.min(surrogate, clipped_surrogate)  # (B, A)
    metrics: dict[str, torch.Tensor] = {}
    if config.dual_clip is not None:
        floor = config.dual_clip * advantages  # (B, A)
        dual_clipped = (advantages < 0) & (floor > objective)  # (B, A)
        objective = torch.where(advantages < 0, torch.max(objective, floor), objective)  # (B, A)
        metrics["policy/dual_clip_frac"] = masked_mean(dual_clipped.to(ratio.dtype), action_mask).detach()
    loss = -objective  # (B, A)

    if inputs.rollout_logprobs is not None:
        metrics["policy/mismatch_kl"] = masked_mean(inputs.rollout_logprobs - old_logprobs, action_mask).detach()
    if config.correction is not None:
        if inputs.rollout_logprobs is None:
            raise RlhfError(
                f"the {config.correction!r} mismatch correction needs the rollout engine's log-probs, and "
                "none were given: use an engine that returns them, or turn the correction off"
            )
        weights, outside = correction_weights(old_logprobs, inputs.rollout_logprobs, kind=config.correction,
                                              bounds=config.correction_bounds, action_mask=action_mask)  # (B, A)
        loss = weights.to(loss.dtype) * loss  # (B, A)
        metrics["policy/correction_weight_mean"] = masked_mean(weights, action_mask).detach()
        metrics["policy/correction_clip_frac"] = masked_mean(outside.to(weights.dtype), action_mask).detach()

    metrics["policy/clip_frac"] = masked_mean((clipped_surrogate < surrogate).to(ratio.dtype), action_mask).detach()
    metrics["policy/approx_kl"] = masked_mean(-raw_log_ratio.detach(), action_mask)
    return masked(loss, action_mask), metrics
