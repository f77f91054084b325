"""The built-in algorithms plugin: registers the algorithm math of docs/algorithms.md through the
same hooks third parties use.

Every torch-using object is registered by ``"module:attr"`` reference with an explicit
description, so importing this module (``rlhf --help``, ``rlhf plugins list``) imports no torch.

Where each piece lives, in this package: the advantage estimators in ``grpo.py`` (grpo, dr_grpo),
``rloo.py``, ``reinforce.py`` (reinforce_pp, reinforce_pp_baseline) and ``gae.py``, with what they
share in ``returns.py`` (reward placement, returns, GAE, whitening) and ``groups.py``; every term of
the policy loss in ``policy_losses.py`` (the ppo, gspo, cispo and sapo losses and their settings, the mismatch
corrections, the KL estimators, the loss aggregations); the presets in ``presets.py``. The
formula that combines the loss terms, and the critic's value loss, are the host's:
``rlhf/algorithms/training_loss.py``.
"""

from __future__ import annotations

from rlhf.api import AdvantageConfig, hookimpl
from rlhf.plugins.algorithms.policy_losses import CORRECTIONS
from rlhf.plugins.algorithms.presets import PRESETS

_HERE = "rlhf.plugins.algorithms"

# name: (reference, description, needs_critic, needs_groups, aliases). The aliases are OpenRLHF's
# --advantage_estimator names for the same math (docs/openrlhf.md).
ESTIMATORS = {
    "gae": ("gae:gae_advantages",
            "PPO: GAE with a critic, Â_t = Σ (γλ)^k δ_{t+k}, whitened", True, False, ()),
    "reinforce_pp": ("reinforce:reinforce_pp_advantages",
                     "REINFORCE++: returns-to-go of r - β·kl, whitened", False, False, ("reinforce",)),
    "reinforce_pp_baseline": ("reinforce:reinforce_pp_baseline_advantages",
                              "REINFORCE++-baseline: r - mean(group), whitened", False, True,
                              ("reinforce_baseline",)),
    "rloo": ("rloo:rloo_advantages",
             "RLOO: r - mean(other samples of the group)", False, True, ()),
    "grpo": ("grpo:grpo_advantages",
             "GRPO: (r - mean(group)) / (std(group) + 1e-9)", False, True, ("group_norm",)),
    "dr_grpo": ("grpo:dr_grpo_advantages",
                "Dr. GRPO: r - mean(group), no std division", False, True, ()),
}


@hookimpl
def register_advantage_estimators(register):
    for name, (ref, description, needs_critic, needs_groups, aliases) in ESTIMATORS.items():
        register(name, f"{_HERE}.{ref}", description=description, config_cls=AdvantageConfig,
                 short_flags=("gamma", "lambd", "std_norm", "reward_clip"), aliases=aliases,
                 needs_critic=needs_critic, needs_groups=needs_groups, supports_masking=True,
                 implements=name)


@hookimpl
def register_kl_estimators(register):
    register("k1", f"{_HERE}.policy_losses:k1",
             description="k1 = δ = logprobs - ref_logprobs (unbiased, may be negative)", implements="k1")
    register("k2", f"{_HERE}.policy_losses:k2", description="k2 = δ²/2 (non-negative)", implements="k2")
    register("k3", f"{_HERE}.policy_losses:k3", description="k3 = exp(-δ) - 1 + δ (unbiased, non-negative)",
             implements="k3")


# ``implements=``: the reference fixtures `rlhf plugins check` runs each component on (docs/algorithms.md,
# "Conformance"); the built-ins are checked against them like any third party.


def corrects_mismatch(config) -> bool:
    """A loss with mismatch corrections (ppo, gspo, cispo, sapo) reads the rollout engine's log-probs
    when one is set."""
    return config is not None and config.correction is not None


@hookimpl
def register_policy_losses(register):
    register("ppo", f"{_HERE}.policy_losses:ppo_policy_loss",
             description="PPO clipped surrogate (asymmetric clip, dual clip, TIS/ICEPOP correction)",
             config_cls=f"{_HERE}.policy_losses:PPOLossConfig", short_flags=("clip_low", "clip_high", "dual_clip"),
             needs_rollout_logprobs=corrects_mismatch,
             advantage_weighted=True, implements=("ppo", *CORRECTIONS))
    register("gspo", f"{_HERE}.policy_losses:gspo_policy_loss",
             description="GSPO: sequence-level ratio exp(mean log-ratio), clipped, per-sequence mean",
             config_cls=f"{_HERE}.policy_losses:PPOLossConfig", short_flags=("clip_low", "clip_high", "dual_clip"),
             needs_rollout_logprobs=corrects_mismatch,
             aggregation="seq_mean_token_mean", advantage_weighted=True, implements=("gspo", *CORRECTIONS))
    register("cispo", f"{_HERE}.policy_losses:cispo_policy_loss",
             description="CISPO: policy gradient weighted by the clipped, gradient-stopped ratio (MiniMax-M1)",
             config_cls=f"{_HERE}.policy_losses:CISPOLossConfig", short_flags=("clip_low", "clip_high"),
             needs_rollout_logprobs=corrects_mismatch, advantage_weighted=True,
             implements=("cispo", *CORRECTIONS))
    register("sapo", f"{_HERE}.policy_losses:sapo_policy_loss",
             description="SAPO: soft sigmoid gate of the ratio (temperatures τ_pos, τ_neg), per-sequence mean",
             config_cls=f"{_HERE}.policy_losses:SAPOLossConfig", short_flags=("tau_pos", "tau_neg"),
             needs_rollout_logprobs=corrects_mismatch,
             aggregation="seq_mean_token_mean", advantage_weighted=True, implements=("sapo", *CORRECTIONS))


@hookimpl
def register_loss_aggregations(register):
    register("token_mean", f"{_HERE}.policy_losses:token_mean",
             description="Σ ℓ m / tokens of the whole optimizer step", sums_rows=True, implements="token_mean")
    register("seq_mean_token_mean", f"{_HERE}.policy_losses:seq_mean_token_mean",
             description="mean over sequences of each sequence's token mean", sums_rows=True,
             implements="seq_mean_token_mean")
    register("seq_mean_token_sum", f"{_HERE}.policy_losses:seq_mean_token_sum",
             description="mean over sequences of each sequence's token sum", sums_rows=True,
             implements="seq_mean_token_sum")
    register("seq_mean_token_sum_norm", f"{_HERE}.policy_losses:seq_mean_token_sum_norm",
             description="mean over sequences of token sum / max new tokens (Dr. GRPO)", sums_rows=True,
             implements="seq_mean_token_sum_norm")


@hookimpl
def register_algorithms(register):
    for name, preset in PRESETS.items():
        register(name, preset)
