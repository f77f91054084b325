"""The loss pieces as functions of names: KL estimate, loss aggregation, policy loss, value loss,
entropy, and `policy_objective`, the whole policy loss a run differentiates.

Each resolves its component through the registries (a name, a reference, a `LoadedComponent` or
the function) and computes what `rlhf.algorithms.training_loss` computes in training, with the
same code: these are for notebooks, tests and plugins that want the run's numbers.

Shape legend: ``B`` sequences, ``A`` action positions, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.algorithms.components import ComponentRef, LoadedComponent, build_config, load_component
from rlhf.algorithms.training_loss import (KL_CLAMP, KL_IS_WEIGHT_CLIP, aggregate, clamped_kl,  # noqa: F401
                                           clipped_value_error, loss_norm, per_token_policy_loss,
                                           policy_training_loss, value_training_loss)

if TYPE_CHECKING:
    import torch

    from rlhf.core.plugin_host.loading import PluginSet


def kl_divergence(estimator: ComponentRef, logp: torch.Tensor, logp_ref: torch.Tensor, *,
                  action_mask: torch.Tensor | None = None, unbiased_gradient: bool = False,
                  logp_old: torch.Tensor | None = None, plugins: PluginSet | None = None) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, clamped to [-10, 10].

    With δ = logp - logp_ref: k1 = δ, k2 = δ²/2, k3 = exp(-δ) - 1 + δ. logp, logp_ref (B, A);
    action_mask (B, A) optional, zeroes masked positions. Differentiable in ``logp`` (the KL
    term of the loss). Returns (B, A). ``unbiased_gradient``: the estimator's value with the
    importance-weighted reverse-KL gradient w·δ·∇logp, w = min(exp(logp - logp_old), 10)
    (`rlhf.algorithms.training_loss.clamped_kl`; OpenRLHF 0.11's
    ``compute_approx_kl(unbiased_gradient=True)``).
    """
    component = load_component("kl_estimator", estimator, plugins=plugins)
    return clamped_kl(component, logp, logp_ref, mask=action_mask, unbiased_gradient=unbiased_gradient,
                      logp_old=logp_old)


def aggregate_loss(aggregation: ComponentRef, loss: torch.Tensor, action_mask: torch.Tensor, *,
                   num_tokens: float | None = None, num_sequences: float | None = None,
                   max_new_tokens: int | None = None, plugins: PluginSet | None = None) -> torch.Tensor:
    """Reduce a per-token loss to this micro-batch's share of the optimizer step's loss.

    token_mean Σ ℓ m / N_tokens; seq_mean_token_mean Σ_i mean_t ℓ / N_seq; seq_mean_token_sum
    Σ_i Σ_t ℓ / N_seq; seq_mean_token_sum_norm Σ_i Σ_t ℓ / max_new_tokens / N_seq. loss,
    action_mask (B, A). ``num_tokens`` / ``num_sequences`` count the whole step (all
    micro-batches and ranks); None: counted from this batch. Returns a scalar.
    """
    component = load_component("loss_aggregation", aggregation, plugins=plugins)
    return aggregate(component, loss, action_mask, loss_norm(action_mask, num_tokens, num_sequences, max_new_tokens))


_POLICY_DEFAULTS = {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "correction": None,
                    "correction_bounds": (0.5, 5.0)}


def loss_aggregation_of(loss: LoadedComponent, aggregation: ComponentRef, *,
                        plugins: PluginSet | None = None) -> LoadedComponent:
    """The aggregation of a policy loss's ℓ term: its own when it declares one (gspo's
    ``seq_mean_token_mean``), else ``aggregation`` (the run's)."""
    return load_component("loss_aggregation", loss.capabilities.get("aggregation") or aggregation, plugins=plugins)


def policy_loss(name: ComponentRef, *, logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: float | None = None, aggregation: ComponentRef = "token_mean",
                num_tokens: float | None = None, max_new_tokens: int | None = None,
                rollout_logp: torch.Tensor | None = None, correction: str | None = None,
                correction_bounds: tuple[float, float] = (0.5, 5.0), num_sequences: float | None = None,
                config: Any = None, plugins: PluginSet | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The policy loss of one micro-batch, aggregated: ``agg(ℓ)``.

    ppo: ρ = exp(clamp(logp - logp_old, -20, 20)); ℓ = -min(ρÂ, clip(ρ, 1 - clip_low, 1 + clip_high)Â);
    dual clip c > 1: for Â < 0, ℓ = -max(min(...), cÂ); correction "tis": ℓ ← clamp(exp(logp_old -
    logp_rollout), lo, hi)·ℓ, "icepop": the same weight unclamped but 0 outside [lo, hi] (detached),
    "seq_mask_tis": the unclamped weight, 0 on every token of a sequence whose geometric mean weight
    leaves [lo, hi]. gspo: one ratio per sequence, exp(masked mean of logp - logp_old), always
    aggregated per sequence (``seq_mean_token_mean``, whatever ``aggregation`` says).

    logp (B, A) with grad; logp_old, advantages, action_mask, rollout_logp (B, A).
    ``num_tokens`` / ``num_sequences`` count the whole optimizer step (None: this batch is the
    step), so summing the micro-batches' losses gives a gradient independent of the split.
    ``config`` replaces the clip / correction keywords with a ready-made config object.
    Returns ``(loss (), metrics)`` with ``policy/clip_frac``, ``policy/approx_kl``, ...
    """
    component = load_component("policy_loss", name, plugins=plugins)
    settings = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip, "correction": correction,
                "correction_bounds": tuple(correction_bounds)}
    config = build_config(component, None, settings, _POLICY_DEFAULTS, config)
    per_token, metrics = per_token_policy_loss(component, config, logp=logp, logp_old=logp_old,
                                               advantages=advantages, mask=action_mask, rollout_logp=rollout_logp)
    norm = loss_norm(action_mask, num_tokens, num_sequences, max_new_tokens)
    return aggregate(loss_aggregation_of(component, aggregation, plugins=plugins), per_token, action_mask,
                     norm), metrics


def policy_objective(name: ComponentRef = "ppo", *, logp: torch.Tensor, logp_old: torch.Tensor,
                     advantages: torch.Tensor, action_mask: torch.Tensor, ref_logp: torch.Tensor | None = None,
                     kl_estimator: ComponentRef = "k3", kl_coef: float = 0.0, entropy: torch.Tensor | None = None,
                     entropy_coef: float = 0.0, aggregation: ComponentRef = "token_mean",
                     num_tokens: float | None = None, num_sequences: float | None = None,
                     max_new_tokens: int | None = None, rollout_logp: torch.Tensor | None = None,
                     kl_unbiased_gradient: bool = False, config: Any = None,
                     plugins: PluginSet | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The policy's loss for one micro-batch, as training computes it: agg(ℓ) + β·agg(clamp(kl)) − c·agg(H)
    (`rlhf.algorithms.training_loss.policy_training_loss`).

    logp (B, A) with grad; logp_old, advantages, action_mask (the loss mask), ref_logp, entropy
    (with grad), rollout_logp (B, A). The KL term needs ``ref_logp`` and is computed on ``logp``
    itself, so its gradient flows (β = ``kl_coef``; 0 leaves the term out). The entropy term
    needs ``entropy`` (c = ``entropy_coef``; 0 leaves it out). ``num_tokens`` /
    ``num_sequences`` / ``max_new_tokens`` are the optimizer step's (None: this batch is the
    step). ``config`` is the policy loss's own config object (e.g. ``PPOLossConfig``).
    ``kl_unbiased_gradient``: the KL term keeps its value but takes the importance-weighted
    reverse-KL gradient w·δ·∇logp, w = min(exp(logp - logp_old), 10) (see `kl_divergence`).

    Returns ``(loss (), metrics)``: the policy loss's metrics, plus ``policy/kl`` (token mean of
    the clamped KL) with the KL term and ``policy/entropy`` (token mean of H) with the entropy term.
    """
    loss = load_component("policy_loss", name, plugins=plugins)
    run_aggregation = load_component("loss_aggregation", aggregation, plugins=plugins)
    return policy_training_loss(
        loss=loss, loss_config=build_config(loss, None, _POLICY_DEFAULTS, _POLICY_DEFAULTS, config),
        aggregation=run_aggregation, loss_aggregation=loss_aggregation_of(loss, run_aggregation, plugins=plugins),
        kl_estimator=load_component("kl_estimator", kl_estimator, plugins=plugins), logp=logp, logp_old=logp_old,
        advantages=advantages, mask=action_mask, norm=loss_norm(action_mask, num_tokens, num_sequences,
                                                                max_new_tokens),
        ref_logp=ref_logp, kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef, rollout_logp=rollout_logp,
        kl_unbiased_gradient=kl_unbiased_gradient)


def value_loss(*, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               clip: float | None = 0.5, aggregation: ComponentRef = "token_mean", num_tokens: float | None = None,
               num_sequences: float | None = None, max_new_tokens: int | None = None,
               plugins: PluginSet | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped critic loss: V_clip = V_old + clamp(V - V_old, -clip, clip);
    L_V = 0.5·agg(max((V_clip - G)², (V - G)²)) (``clip=None``: 0.5·agg((V - G)²)).

    values (B, A) with grad; old_values, returns, action_mask (B, A). Returns ``(loss (), metrics)``
    with ``critic/clip_frac`` (share of tokens where the clipped error is the larger) and
    ``critic/values`` (mean value over action tokens).
    """
    return value_training_loss(values=values, old_values=old_values, returns=returns, mask=action_mask,
                               norm=loss_norm(action_mask, num_tokens, num_sequences, max_new_tokens),
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
