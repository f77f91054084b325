"""RLOO advantages: each sample's baseline is the mean reward of the other samples of its prompt.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs" (arXiv:2402.14740), after Kool et al. 2019 ("Buy 4 REINFORCE samples, get
a baseline for free"): Â_i = r_i - (Σ_j r_j - r_i) / (n - 1), the same value on every action token.

Then, as every built-in estimator (``returns.py``): clip to [-10, 10], -β·kl_t per token when KL
is in the reward, returns-to-go with γ = 1.

Failed samples (``--on-failure mask``, docs/outcomes.md; ``sample_mask`` False) are left out: over
the k successful samples S of the group, Â_i = r_i - Σ_{j∈S, j≠i} r_j / (k - 1), still unbiased
(the baseline never includes r_i); a failed sample gets 0, and so does a group with k < 2.

Deviations from the paper (as OpenRLHF at HEAD): the KL penalty is per token rather than one
sequence-level term, and there is no batch whitening (OpenRLHF whitened RLOO before 2025-06).

Shape legend: ``B`` sequences, ``A`` action positions, ``G`` prompts, ``n`` samples per prompt.
"""

from __future__ import annotations

import torch

from rlhf.api import AdvantageConfig, AdvantageInputs
from rlhf.plugins.algorithms.groups import grouped, leave_one_out_mean, ungrouped
from rlhf.plugins.algorithms.returns import returns_from_sequence_rewards, unit_gamma


def rloo_advantages(inputs: AdvantageInputs, config: AdvantageConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: Â_i = r_i - mean_{j≠i} r_j (leave-one-out mean of the group) on every action token.

    inputs.rewards (B,), inputs.action_mask (B, A). Returns ``(advantages (B, A), returns (B, A))``,
    equal to each other (no batch whitening), 0 where the action mask is 0. γ is always 1.
    """
    config = config or AdvantageConfig()
    gamma = unit_gamma("rloo", config)
    rewards, valid = grouped(inputs)  # (G, n), (G, n)
    shaped = rewards - leave_one_out_mean(rewards, valid)  # (G, n)
    return returns_from_sequence_rewards(ungrouped(shaped, valid), inputs, config, gamma=gamma, whiten_advantages=False)
