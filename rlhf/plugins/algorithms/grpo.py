"""GRPO and Dr. GRPO advantages: the group of n samples of a prompt is the baseline.

- ``grpo``: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), §4.1.2 outcome supervision:
  Â_i = (r_i - mean(r_group)) / (std(r_group) + 1e-9), the same value on every action token.
- ``dr_grpo``: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (arXiv:2503.20783): Â_i = r_i - mean(r_group), without the division by the std (which biases
  updates towards groups whose rewards barely differ).

Both clip the shaped reward to [-10, 10], add -β·kl_t per token when KL is in the reward, sum
returns-to-go with γ = 1, and do not whiten over the batch (``returns.py``).

Failed samples (``--on-failure mask``, docs/outcomes.md; ``sample_mask`` False) are left out: over
the k successful samples S of the group, GRPO gives Â_i = (r_i - mean_S r) / (std_S r + 1e-9) with
the unbiased std sqrt(Σ_S (r_j - mean_S r)² / (k - 1)), Dr. GRPO Â_i = r_i - mean_S r; a failed
sample gets 0, and so does every sample of a group with k < 2 (nothing to compare with).

Deviations from the papers (as OpenRLHF):
1. The std is the unbiased (N - 1) group std, plus 1e-9 (the paper does not say which).
2. Dr. GRPO's other change, a constant loss normaliser, is not part of the estimator: it is the
   ``seq_mean_token_sum_norm`` aggregation, which the ``dr_grpo`` preset selects.
3. GRPO's KL term lives in the loss in the paper; here that is the preset's choice (``--kl-in``).

Shape legend: ``B`` sequences, ``A`` action positions, ``G`` prompts, ``n`` samples per prompt.
"""

from __future__ import annotations

import torch

from rlhf.api import AdvantageConfig, AdvantageInputs
from rlhf.plugins.algorithms.groups import group_mean, group_std, grouped, ungrouped
from rlhf.plugins.algorithms.returns import returns_from_sequence_rewards, unit_gamma

GRPO_STD_EPS = 1e-9


def grpo_advantages(inputs: AdvantageInputs, config: AdvantageConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: Â_i = (r_i - mean(r_group)) / (std(r_group) + 1e-9) on every action token of sample i.

    inputs.rewards (B,), inputs.action_mask (B, A). Returns ``(advantages (B, A), returns (B, A))``,
    equal to each other (no batch whitening), 0 where the action mask is 0. γ is always 1.
    """
    config = config or AdvantageConfig()
    gamma = unit_gamma("grpo", config)
    rewards, valid = grouped(inputs)  # (G, n), (G, n)
    shaped = (rewards - group_mean(rewards, valid)) / (group_std(rewards, valid) + GRPO_STD_EPS)  # (G, n)
    return returns_from_sequence_rewards(ungrouped(shaped, valid), inputs, config, gamma=gamma, whiten_advantages=False)


def dr_grpo_advantages(inputs: AdvantageInputs, config: AdvantageConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: Â_i = r_i - mean(r_group) on every action token of sample i (no std division).

    inputs.rewards (B,), inputs.action_mask (B, A). Returns ``(advantages (B, A), returns (B, A))``,
    equal to each other (no batch whitening), 0 where the action mask is 0. γ is always 1.
    """
    config = config or AdvantageConfig()
    gamma = unit_gamma("dr_grpo", config)
    rewards, valid = grouped(inputs)  # (G, n), (G, n)
    shaped = rewards - group_mean(rewards, valid)  # (G, n)
    return returns_from_sequence_rewards(ungrouped(shaped, valid), inputs, config, gamma=gamma, whiten_advantages=False)
