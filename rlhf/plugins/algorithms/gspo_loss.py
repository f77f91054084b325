"""GSPO: the clipped surrogate with one importance ratio per sequence.

Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), as OpenRLHF's
``PolicyLoss(policy_loss_type="gspo")``:

    s_i   = exp(Σ_t (logp_{i,t} - logp_old_{i,t}) m_{i,t} / max(Σ_t m_{i,t}, 1))   (geometric mean ratio)
    ℓ_i,t = -min(s_i Â_{i,t}, clip(s_i, 1 - ε_low, 1 + ε_high) Â_{i,t})   on action tokens

The ratio is the sequence's, but its gradient reaches every token through the mean log-ratio.
Dual clip applies as in ``ppo``. With a mismatch correction set (any of tis / icepop /
seq_mask_tis), the ratio is taken against the rollout engine's log-probs instead of the old
ones and no further weight is applied (OpenRLHF's behaviour). The log-ratio is not clamped.

The loss is always aggregated per sequence (``seq_mean_token_mean``): the registration declares
``aggregation="seq_mean_token_mean"``, which replaces the run's ``--loss-agg`` for this term (the
KL and entropy terms keep the run's). Metrics as ``ppo``: ``policy/clip_frac``,
``policy/approx_kl``, ``policy/dual_clip_frac``, ``policy/mismatch_kl``.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch

from rlhf.api import PolicyLossInputs, RlhfError, masked, masked_mean, masked_sum
from rlhf.plugins.algorithms.ppo_config import PPOLossConfig


def gspo_policy_loss(inputs: PolicyLossInputs,
                     config: PPOLossConfig | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: ℓ_t = -min(s Â_t, clip(s, 1 - ε_low, 1 + ε_high) Â_t), s = exp(masked mean of logp - logp_old).

    inputs.logprobs (B, A) with grad; old_logprobs, advantages, action_mask, rollout_logprobs
    (B, A). Returns ``(per_token_loss (B, A), metrics)``.
    """
    config = config or PPOLossConfig()
    logprobs, advantages, action_mask = inputs.logprobs, inputs.advantages, inputs.action_mask
    raw_log_ratio = logprobs - inputs.old_logprobs  # (B, A)
    if config.correction is not None:
        if inputs.rollout_logprobs is None:
            raise RlhfError(f"gspo with the {config.correction!r} correction takes its ratio against the rollout "
                            "engine's log-probs, and none were given: use an engine that returns them, or turn "
                            "the correction off")
        log_ratio = logprobs - inputs.rollout_logprobs  # (B, A)
    else:
        log_ratio = raw_log_ratio
    tokens = action_mask.sum(dim=-1).clamp(min=1)  # (B,)
    sequence_ratio = (masked_sum(log_ratio, action_mask, dim=-1) / tokens).exp()  # (B,)
    ratio = sequence_ratio[:, None] * action_mask  # (B, A), 0 off the mask
    surrogate = ratio * advantages  # (B, A)
    clipped_surrogate = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages  # (B, A)
    objective = torch.min(surrogate, clipped_surrogate)  # (B, A)
    metrics: dict[str, torch.Tensor] = {}
    if config.dual_clip is not None:
        floor = config.dual_clip * advantages  # (B, A)
        metrics["policy/dual_clip_frac"] = masked_mean(((advantages < 0) & (floor > objective)).to(ratio.dtype),
                                                       action_mask).detach()
        objective = torch.where(advantages < 0, torch.max(objective, floor), objective)  # (B, A)
    if inputs.rollout_logprobs is not None:
        metrics["policy/mismatch_kl"] = masked_mean(inputs.rollout_logprobs - inputs.old_logprobs,
                                                    action_mask).detach()
    metrics["policy/clip_frac"] = masked_mean((clipped_surrogate < surrogate).to(ratio.dtype), action_mask).detach()
    metrics["policy/approx_kl"] = masked_mean(-raw_log_ratio.detach(), action_mask)
    return masked(-objective, action_mask), metrics
