"""The loss pieces as functions: KL estimate, loss aggregation, policy loss, value loss, entropy.

Each resolves its component through the registries (a name, a reference, a `LoadedComponent` or
the function) and checks shapes; `rlhf.algorithms.objective` combines them into what training
differentiates.

Shape legend: ``B`` sequences, ``A`` action positions, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.algorithms.components import AlgorithmConfigError, ComponentRef, build_config, check_shape, load_component
from rlhf.core.errors import PluginError
from rlhf.core.types import LossNorm, PolicyLossInputs

if TYPE_CHECKING:
    import torch

    from rlhf.core.plugins import PluginSet

KL_CLAMP = 10.0  # every KL estimate is clamped to [-10, 10]


KL_IS_WEIGHT_CLIP = 10.0  # the importance weight of the unbiased KL gradient is clamped above at this


def kl_divergence(estimator: ComponentRef, logp: torch.Tensor, logp_ref: torch.Tensor, *,
                  action_mask: torch.Tensor | None = None, unbiased_gradient: bool = False,
                  logp_old: torch.Tensor | None = None, plugins: PluginSet | None = None) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, clamped to [-10, 10].

    With δ = logp - logp_ref: k1 = δ, k2 = δ²/2, k3 = exp(-δ) - 1 + δ. logp, logp_ref (B, A);
    action_mask (B, A) optional, zeroes masked positions. Differentiable in ``logp`` (the KL
    term of the loss). Returns (B, A).

    ``unbiased_gradient``: the value stays the estimator's, but the gradient becomes the
    importance-weighted score-function gradient of the reverse KL, ∇ = w·δ·∇logp with
    w = min(exp(logp - logp_old), 10) detached (w = 1 without ``logp_old``), whatever the
    estimator: kl ← value.detach() + w·δ²/2 - (w·δ²/2).detach() (OpenRLHF 0.11's
    ``compute_approx_kl(unbiased_gradient=True)``). Samples come from the old policy, so
    E_old[w·δ·∇logp] = ∇ KL(π ‖ π_ref); the plain estimators' pathwise gradients are biased
    for it (k1's is 1 on every token).
    """
    import torch

    component = load_component("kl_estimator", estimator, plugins=plugins)
    check_shape("logp_ref", logp_ref, tuple(logp.shape))
    kl = component(logp, logp_ref)  # (B, A)
    if not isinstance(kl, torch.Tensor) or kl.shape != logp.shape:
        raise PluginError(f"kl estimator {component.name!r} must return a tensor of shape {tuple(logp.shape)}")
    kl = kl.clamp(min=-KL_CLAMP, max=KL_CLAMP)  # (B, A)
    if unbiased_gradient:
        delta = logp.float() - logp_ref.float()  # (B, A)
        weight = 1.0
        if logp_old is not None:
            check_shape("logp_old", logp_old, tuple(logp.shape))
            weight = (logp.float() - logp_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()  # (B, A)
        surrogate = weight * delta.pow(2) / 2  # (B, A): its gradient is w·δ·∇logp
        kl = kl.detach() + surrogate - surrogate.detach()  # (B, A): the estimator's value, the surrogate's gradient
    if action_mask is not None:
        check_shape("action_mask", action_mask, tuple(logp.shape))
        kl = torch.where(action_mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))  # (B, A)
    return kl


def loss_norm(action_mask: torch.Tensor, num_tokens: Any = None, num_sequences: Any = None,
              max_new_tokens: int | None = None) -> LossNorm:
    """Step-wide counts for the aggregations; those not given are counted from ``action_mask``
    (B, A), which is then the whole step: action tokens, and sequences with at least one."""
    mask = action_mask.bool()  # (B, A)
    if num_tokens is None:
        num_tokens = float(mask.sum())
    if num_sequences is None:
        num_sequences = float(mask.any(dim=-1).sum())
    return LossNorm(num_tokens=num_tokens, num_sequences=num_sequences, max_new_tokens=max_new_tokens)


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
    check_shape("action_mask", action_mask, tuple(loss.shape))
    norm = loss_norm(action_mask, num_tokens, num_sequences, max_new_tokens)
    return component(loss, action_mask.to(loss.dtype), norm)


_POLICY_DEFAULTS = {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "correction": None,
                    "correction_bounds": (0.5, 5.0)}


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
    import torch

    component = load_component("policy_loss", name, plugins=plugins)
    shape = tuple(logp.shape)
    for arg, tensor in (("logp_old", logp_old), ("advantages", advantages), ("action_mask", action_mask),
                        ("rollout_logp", rollout_logp)):
        if tensor is not None:
            check_shape(arg, tensor, shape)
    settings = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip, "correction": correction,
                "correction_bounds": tuple(correction_bounds)}
    config = build_config(component, None, settings, _POLICY_DEFAULTS, config)
    mask = action_mask.to(logp.dtype)  # (B, A)
    inputs = PolicyLossInputs(logprobs=logp, old_logprobs=logp_old, advantages=advantages, action_mask=mask,
                              rollout_logprobs=rollout_logp)
    result = component(inputs, config)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and tuple(result[0].shape) == shape):
        raise PluginError(f"policy loss {component.name!r} must return (per_token_loss, metrics) with a "
                          f"loss of shape {shape}")
    per_token_loss, metrics = result
    # A loss defined with its own aggregation (gspo: per sequence) declares it; it wins over the run's.
    aggregation = component.capabilities.get("aggregation") or aggregation
    loss = aggregate_loss(aggregation, per_token_loss, mask, num_tokens=num_tokens, num_sequences=num_sequences,
                          max_new_tokens=max_new_tokens, plugins=plugins)
    return loss, dict(metrics)


def clipped_value_error(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token max((V_clip - G)², (V - G)²), V_clip = V_old + clamp(V - V_old, -c, c), and where the
    clipped term is the larger. values (B, A) with grad; old_values, returns (B, A).

    Schulman et al. 2017 (arXiv:1707.06347) as OpenAI baselines' ``ppo2`` and OpenRLHF clip the
    critic: the new value may move at most ``clip`` from the value at rollout time, and the larger
    of the clipped and unclipped squared errors is kept. ``clip=None``: (V - G)².
    Returns ``(error (B, A), clipped (B, A) bool)``.
    """
    import torch

    for name, tensor in (("old_values", old_values), ("returns", returns)):
        check_shape(name, tensor, tuple(values.shape))
    unclipped = (values - returns).pow(2)  # (B, A)
    if clip is None:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    values_clipped = old_values + (values - old_values).clamp(-clip, clip)  # (B, A)
    clipped = (values_clipped - returns).pow(2)  # (B, A)
    return torch.max(clipped, unclipped), (clipped > unclipped).detach()


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
    from rlhf.core.masked import masked_mean

    if clip is not None and not clip > 0:
        raise AlgorithmConfigError(f"value clip must be positive (or None for no clipping), got {clip}")
    check_shape("action_mask", action_mask, tuple(values.shape))
    error, clipped = clipped_value_error(values, old_values, returns, clip)  # (B, A), (B, A)
    loss = 0.5 * aggregate_loss(aggregation, error, action_mask, num_tokens=num_tokens, num_sequences=num_sequences,
                                max_new_tokens=max_new_tokens, plugins=plugins)
    metrics = {
        "critic/clip_frac": masked_mean(clipped.to(error.dtype), action_mask).detach(),
        "critic/values": masked_mean(values.detach(), action_mask),
    }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy H = logsumexp(z) - Σ softmax(z)·z, in float32. logits (B, A, V) -> (B, A).

    The policy objective subtracts ``entropy_coef · agg(H)`` from the loss (OpenRLHF's sign).
    """
    import torch

    logits = logits if logits.dtype == torch.float64 else logits.float()  # (B, A, V)
    probs = torch.softmax(logits, dim=-1)  # (B, A, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)  # (B, A)
