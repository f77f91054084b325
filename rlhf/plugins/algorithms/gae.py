"""PPO's advantages: Generalized Advantage Estimation with a learned critic.

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation" (arXiv:1506.02438); applied to language models as in Ouyang et al. 2022
(arXiv:2203.02155): the sequence reward sits on the last action token and -β·kl_t on every
action token.

δ_t = R_t + γ V_{t+1} - V_t,  Â_t = δ_t + γλ Â_{t+1},  returns = Â + V,  then Â is whitened over
every action token of the rollout batch (``returns.py``).

Deviations from the paper (as OpenRLHF): masked positions (prompt, padding, environment tokens
between turns) carry V = R = 0 and the recursion runs through them, so with γ = λ = 1,
Â_t = Σ_{k≥t} R_k - V_t across the turns of a multi-turn sample.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

import torch

from rlhf.api import AdvantageConfig, AdvantageInputs, as_float, masked
from rlhf.plugins.algorithms.returns import gae, loss_mask_of, token_rewards, whiten


def gae_advantages(inputs: AdvantageInputs, config: AdvantageConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: Â_t = Σ_k (γλ)^k δ_{t+k}, δ_t = R_t + γV_{t+1} - V_t; returns = Â + V; Â whitened.

    inputs.rewards (B,), inputs.values (B, A) (required), inputs.action_mask (B, A). Returns
    ``(advantages (B, A), returns (B, A))``, returns not whitened, both 0 where the mask is 0.
    """
    config = config or AdvantageConfig()
    assert inputs.values is not None, "gae needs critic values (inputs.values)"
    loss_mask = loss_mask_of(inputs)  # (B, A)
    rewards = token_rewards(as_float(inputs.rewards), loss_mask, kl=inputs.kl, kl_coef=inputs.kl_coef,
                            reward_clip=config.reward_clip)  # (B, A)
    advantages, returns = gae(rewards, inputs.values, loss_mask, gamma=config.gamma, lambd=config.lambd)  # (B, A)
    advantages = whiten(advantages, loss_mask, std_norm=config.std_norm)  # (B, A)
    return masked(advantages, loss_mask), masked(returns, loss_mask)
