"""The algorithm math as plain functions, for the trainer, plugins, notebooks and tests (docs/algorithms.md).

Training calls `PolicyTrainingLoss` / `ValueTrainingLoss` (``training_loss.py``: the whole
formula, L = agg(ℓ) + β·agg(kl) − c·agg(H), in one place); `policy_objective`, `value_loss` and
the other functions of ``losses.py`` resolve names and call the same code: what they give is what
a run optimises. The built-in terms themselves are plugins (rlhf/plugins/algorithms/policy_losses.py).

Every function takes the component to use as its first argument: a registered name (``"grpo"``,
``"k3"``, ``"ppo"``, ``"token_mean"``), a ``"module.path:attr"`` or ``"file.py:attr"`` reference,
a `LoadedComponent` (what `resolve_algorithm` returns, so a run resolves names once), or the
function itself. Names resolve through the registries, so a third-party estimator registered by
a plugin is usable here by its name. ``plugins`` is the `PluginSet` to resolve names in; when
None, one built with ``build_plugin_manager()`` on first use (never at import) is kept for the
process.

Example::

    import torch
    from rlhf.algorithms import compute_advantages, policy_loss, policy_objective

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])            # (B,) one prompt, n = 4 samples
    action_mask = torch.ones(4, 3)                          # (B, A)
    advantages, returns = compute_advantages("grpo", rewards=rewards, action_mask=action_mask,
                                             group_size=4)  # advantages[:, 0] = [1.5, -.5, -.5, -.5]
    logprobs = torch.zeros(4, 3, requires_grad=True)
    loss, metrics = policy_loss("ppo", logprobs=logprobs, old_logprobs=logprobs.detach(),
                                advantages=advantages, loss_mask=action_mask, clip_high=0.28)
    ref_logprobs = torch.full((4, 3), -0.5)                 # (B, A) reference log-probs
    loss, metrics = policy_objective("ppo", logprobs=logprobs, old_logprobs=logprobs.detach(),
                                     advantages=advantages, loss_mask=action_mask, ref_logprobs=ref_logprobs,
                                     kl_estimator="k3", kl_coef=0.001)

Shape legend: ``B`` sequences (the n samples of a prompt are contiguous rows), ``A`` action
positions (``T - 1``: position t holds the log-prob of token t+1), ``V`` vocabulary.
"""

from __future__ import annotations

from rlhf.algorithms.advantages import compute_advantages
from rlhf.algorithms.components import AlgorithmConfigError, ComponentRef, LoadedComponent, load_component
from rlhf.algorithms.losses import (aggregate_loss, entropy_from_logits, kl_divergence, policy_loss, policy_objective,
                                    value_loss)
from rlhf.algorithms.presets import KL_PLACEMENTS, ResolvedAlgorithm, resolve_algorithm
from rlhf.algorithms.training_loss import (KL_CLAMP, PolicyTrainingLoss, ValueTrainingLoss, clipped_value_error,
                                           step_norm)

__all__ = [
    "KL_CLAMP", "KL_PLACEMENTS", "AlgorithmConfigError", "ComponentRef", "LoadedComponent", "PolicyTrainingLoss",
    "ResolvedAlgorithm", "ValueTrainingLoss", "aggregate_loss", "clipped_value_error", "compute_advantages",
    "entropy_from_logits", "kl_divergence", "load_component", "policy_loss", "policy_objective",
    "resolve_algorithm", "step_norm", "value_loss",
]
