"""The loss functions of names, for notebooks, tests and plugins that want a run's numbers.

Each resolves its components (a registered name, a ``module:attr`` / ``file.py:attr`` reference, a
`LoadedComponent` or the function itself) and calls the formula of `rlhf.algorithms.training_loss`,
the code training runs: nothing here restates a formula or knows a component's settings. A policy
loss's settings are passed by name (``clip_high=0.28``) to its own config class, which supplies the
defaults; ``config=`` passes a ready-made config object instead.

Shape legend: ``B`` sequences, ``A`` action positions, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.algorithms.components import ComponentRef, config_from_settings, load_component
from rlhf.algorithms.training_loss import (aggregate, clamped_kl, loss_aggregation_of, loss_norm,
                                           policy_training_loss, value_training_loss)

if TYPE_CHECKING:
    import torch

    from rlhf.core.plugin_host.loading import PluginSet


def kl_divergence(estimator: ComponentRef, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *,
                  mask: torch.Tensor | None = None, unbiased_gradient: bool = False,
                  old_logprobs: torch.Tensor | None = None, plugins: PluginSet | None = None) -> torch.Tensor:
    """The KL term's per-token estimate, clamped to [-10, 10] and 0 off ``mask``
    (`training_loss.clamped_kl`). logprobs, ref_logprobs, mask, old_logprobs (B, A) -> (B, A).

    Differentiable in ``logprobs``. ``unbiased_gradient``: the estimator's value with the
    importance-weighted reverse-KL gradient, weighted by exp(logprobs - old_logprobs) clamped at 10.
    """
    component = load_component("kl_estimator", estimator, plugins=plugins)
    return clamped_kl(component, logprobs, ref_logprobs, mask=mask, unbiased_gradient=unbiased_gradient,
                      old_logprobs=old_logprobs)


def aggregate_loss(aggregation: ComponentRef, loss: torch.Tensor, loss_mask: torch.Tensor, *,
                   num_tokens: float | None = None, num_sequences: float | None = None,
                   max_new_tokens: int | None = None, plugins: PluginSet | None = None) -> torch.Tensor:
    """agg(loss): a per-token loss reduced to this micro-batch's share of the optimizer step's loss.

    loss, loss_mask (B, A) -> (). ``num_tokens`` / ``num_sequences`` count the whole step (all
    micro-batches and ranks); None: counted from this batch.
    """
    component = load_component("loss_aggregation", aggregation, plugins=plugins)
    return aggregate(component, loss, loss_mask, loss_norm(loss_mask, num_tokens, num_sequences, max_new_tokens))


def policy_objective(name: ComponentRef = "ppo", *, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     advantages: torch.Tensor, loss_mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                     kl_estimator: ComponentRef = "k3", kl_coef: float = 0.0, entropy: torch.Tensor | None = None,
                     entropy_coef: float = 0.0, aggregation: ComponentRef = "token_mean",
                     num_tokens: float | None = None, num_sequences: float | None = None,
                     max_new_tokens: int | None = None, rollout_logprobs: torch.Tensor | None = None,
                     kl_unbiased_gradient: bool = False, config: Any = None, plugins: PluginSet | None = None,
                     **settings: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """The policy's loss for one micro-batch, as training computes it: agg(ℓ) + β·agg(clamp(kl)) − c·agg(H)
    (`training_loss.policy_training_loss`).

    logprobs (B, A) with grad; old_logprobs, advantages, loss_mask, ref_logprobs, entropy (with
    grad), rollout_logprobs (B, A). The KL term needs ``ref_logprobs`` (β = ``kl_coef``; 0 leaves it
    out), the entropy term ``entropy`` (c = ``entropy_coef``; 0 leaves it out).
    ``num_tokens`` / ``num_sequences`` / ``max_new_tokens`` are the optimizer step's (None: this
    batch is the step). ``settings``: the policy loss's settings by name (``clip_high=0.28``), or
    ``config``, its config object. Returns ``(loss (), metrics)``: the policy loss's metrics, plus
    ``policy/kl`` with the KL term and ``policy/entropy`` with the entropy term.
    """
    loss = load_component("policy_loss", name, plugins=plugins)
    run_aggregation = load_component("loss_aggregation", aggregation, plugins=plugins)
    return policy_training_loss(
        loss=loss, loss_config=config_from_settings(loss, settings, config), aggregation=run_aggregation,
        loss_aggregation=loss_aggregation_of(loss, run_aggregation, plugins=plugins),
        kl_estimator=load_component("kl_estimator", kl_estimator, plugins=plugins), logprobs=logprobs,
        old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask,
        norm=loss_norm(loss_mask, num_tokens, num_sequences, max_new_tokens), ref_logprobs=ref_logprobs,
        kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef, rollout_logprobs=rollout_logprobs,
        kl_unbiased_gradient=kl_unbiased_gradient)


def policy_loss(name: ComponentRef, *, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, aggregation: ComponentRef = "token_mean", num_tokens: float | None = None,
                num_sequences: float | None = None, max_new_tokens: int | None = None,
                rollout_logprobs: torch.Tensor | None = None, config: Any = None, plugins: PluginSet | None = None,
                **settings: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """agg(ℓ), the policy loss term alone: `policy_objective` without the KL and entropy terms.

    ℓ is the policy loss ``name``'s (the built-ins: rlhf/plugins/algorithms/policy_losses.py),
    aggregated with its own aggregation when it declares one (gspo), else ``aggregation``.
    ``settings`` / ``config`` as for `policy_objective` (``ppo``: ``clip_low``, ``clip_high``,
    ``dual_clip``, ``correction``, ``correction_bounds``). Returns ``(loss (), metrics)`` with
    ``policy/clip_frac``, ``policy/approx_kl``, ...
    """
    return policy_objective(name, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                            loss_mask=loss_mask, aggregation=aggregation, num_tokens=num_tokens,
                            num_sequences=num_sequences, max_new_tokens=max_new_tokens,
                            rollout_logprobs=rollout_logprobs, config=config, plugins=plugins, **settings)


def value_loss(*, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
               clip: float | None = 0.5, aggregation: ComponentRef = "token_mean", num_tokens: float | None = None,
               num_sequences: float | None = None, max_new_tokens: int | None = None,
               plugins: PluginSet | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The critic's clipped loss 0.5·agg(max((V_clip - G)², (V - G)²)) (`training_loss.value_training_loss`).

    values (B, A) with grad; old_values, returns, loss_mask (B, A). Returns ``(loss (), metrics)``
    with ``critic/clip_frac`` and ``critic/values``.
    """
    return value_training_loss(values=values, old_values=old_values, returns=returns, loss_mask=loss_mask,
                               norm=loss_norm(loss_mask, num_tokens, num_sequences, max_new_tokens),
                               aggregation=load_component("loss_aggregation", aggregation, plugins=plugins),
                               clip=clip)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy H = logsumexp(z) - Σ softmax(z)·z, in float32. logits (B, A, V) -> (B, A).

    The policy objective subtracts ``entropy_coef · agg(H)`` from the loss (OpenRLHF's sign).
    """
    import torch

    logits = logits if logits.dtype == torch.float64 else logits.float()  # (B, A, V)
    probs = torch.softmax(logits, dim=-1)  # (B, A, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)  # (B, A)
