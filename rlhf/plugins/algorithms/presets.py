"""Algorithm presets (``--algo NAME``): the defaults of docs/algorithms.md, each overridable by its own flag
(``--advantage``, ``--policy-loss``, ``--kl-estimator``, ``--kl-coef``, ``--kl-in``, ``--loss-agg``).

KL is in the reward (k1, β = 0.01), in the loss (k3, β = 0.001) or, for cispo and sapo as their papers,
nowhere; never in both. Whether a critic is built follows from the estimator (only ``gae`` needs
one). No torch here.
"""

from __future__ import annotations

from rlhf.api import AlgorithmPreset

PRESETS: dict[str, AlgorithmPreset] = {
    "ppo": AlgorithmPreset(
        advantage="gae", kl_estimator="k1", kl_in="reward", kl_coef=0.01, loss_agg="token_mean",
        description="PPO with a critic: GAE advantages, k1 KL in the reward (β 0.01)",
    ),
    "reinforce_pp": AlgorithmPreset(
        advantage="reinforce_pp", kl_estimator="k1", kl_in="reward", kl_coef=0.01, loss_agg="token_mean",
        description="REINFORCE++: whitened returns-to-go, k1 KL in the reward (β 0.01)",
    ),
    "reinforce_pp_baseline": AlgorithmPreset(
        advantage="reinforce_pp_baseline", kl_estimator="k3", kl_in="loss", kl_coef=0.001, loss_agg="token_mean",
        description="REINFORCE++-baseline: group-mean baseline, whitened; k3 KL loss (β 0.001)",
    ),
    "rloo": AlgorithmPreset(
        advantage="rloo", kl_estimator="k1", kl_in="reward", kl_coef=0.01, loss_agg="token_mean",
        description="RLOO: leave-one-out group baseline, k1 KL in the reward (β 0.01)",
    ),
    "grpo": AlgorithmPreset(
        advantage="grpo", kl_estimator="k3", kl_in="loss", kl_coef=0.001, loss_agg="token_mean",
        description="GRPO: group-normalised rewards, k3 KL loss (β 0.001)",
    ),
    "dr_grpo": AlgorithmPreset(
        advantage="dr_grpo", kl_estimator="k3", kl_in="loss", kl_coef=0.001, loss_agg="seq_mean_token_sum_norm",
        description="Dr. GRPO: group-mean baseline, constant length normaliser, k3 KL loss (β 0.001)",
    ),
    # MiniMax-M1 (arXiv:2506.13585): group-normalised advantages, no KL, token-level normalisation. TRL's
    # default is the same (β 0); verl's example adds a k3 KL loss (β 0.001): --kl-in loss --kl-coef 0.001.
    "cispo": AlgorithmPreset(
        advantage="grpo", policy_loss="cispo", kl_estimator="k3", kl_in="none", kl_coef=0.0, loss_agg="token_mean",
        description="CISPO: GRPO advantages, clipped gradient-stopped IS weight, no KL, token mean",
    ),
    # SAPO (arXiv:2511.20347) and verl's recipe: group-normalised advantages, no KL, per-sequence mean.
    "sapo": AlgorithmPreset(
        advantage="grpo", policy_loss="sapo", kl_estimator="k3", kl_in="none", kl_coef=0.0,
        loss_agg="seq_mean_token_mean",
        description="SAPO: GRPO advantages, soft gate of the ratio (τ 1.0 / 1.05), no KL, per-sequence mean",
    ),
    "opd": AlgorithmPreset(
        advantage="grpo", kl_estimator="k1", kl_in="none", kl_coef=0.0, loss_agg="token_mean", needs_teacher=True,
        description="On-policy distillation: −(student − teacher log-prob) of each sampled token as its advantage "
                    "(--teacher), plus GRPO's when rewards are given; no KL term",
    ),
}
