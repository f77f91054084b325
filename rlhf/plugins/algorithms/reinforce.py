"""REINFORCE++ and REINFORCE++-baseline advantages: returns-to-go whitened over the whole batch.

Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
(arXiv:2501.03262):

- ``reinforce_pp``: G_t = m_t R_t + γ G_{t+1} with R_t = -β·kl_t + r on the last action token;
  Â = whiten(G) over every action token of the rollout batch. Honours γ.
- ``reinforce_pp_baseline``: the same with the group-mean baseline r̃_i = r_i - mean(r_group)
  (γ = 1, so with no KL every action token of sample i gets r̃_i before whitening).

Whitening is token-weighted: μ = Σ Â m / Σ m, σ² = Σ (Â - μ)² m / Σ m,
Â ← (Â - μ) / sqrt(max(σ², 1e-8)); ``std_norm=False`` subtracts μ only (``returns.py``).

Failed samples (``--on-failure mask``, docs/outcomes.md; ``sample_mask`` False) are left out:
REINFORCE++-baseline's mean is over the k successful samples S of the group, r̃_i = r_i - mean_S r,
and the whitening's μ and σ are over the successful samples' tokens only; a failed sample gets 0
(REINFORCE++ has no group: its whitening alone leaves failed samples out).

Deviations from the paper: none beyond OpenRLHF's (reward clipped to [-10, 10] first).

Shape legend: ``B`` sequences, ``A`` action positions, ``G`` prompts, ``n`` samples per prompt.
"""

from __future__ import annotations

import torch

from rlhf.api import AdvantageConfig, AdvantageInputs, as_float
from rlhf.plugins.algorithms.groups import group_mean, grouped, ungrouped
from rlhf.plugins.algorithms.returns import returns_from_sequence_rewards, unit_gamma


def reinforce_pp_advantages(inputs: AdvantageInputs, config: AdvantageConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: Â = whiten(G), G_t = m_t R_t + γ G_{t+1}, R_t = -β·kl_t + [t last]·r.

    inputs.rewards (B,), inputs.action_mask (B, A). Returns ``(advantages (B, A), returns (B, A))``
    with returns = G (not whitened), both 0 where the action mask is 0.
    """
    config = config or AdvantageConfig()
    return returns_from_sequence_rewards(as_float(inputs.rewards), inputs, config, gamma=config.gamma,
                                         whiten_advantages=True)


def reinforce_pp_baseline_advantages(inputs: AdvantageInputs,
                                     config: AdvantageConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: Â = whiten(G) with the shaped reward r̃_i = r_i - mean(r_group), γ = 1.

    inputs.rewards (B,), inputs.action_mask (B, A). Returns ``(advantages (B, A), returns (B, A))``
    with returns = G (not whitened), both 0 where the action mask is 0.
    """
    config = config or AdvantageConfig()
    gamma = unit_gamma("reinforce_pp_baseline", config)
    rewards, valid = grouped(inputs)  # (G, n), (G, n)
    shaped = rewards - group_mean(rewards, valid)  # (G, n)
    return returns_from_sequence_rewards(ungrouped(shaped, valid), inputs, config, gamma=gamma, whiten_advantages=True)
