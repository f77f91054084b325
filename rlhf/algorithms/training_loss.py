"""What RL training differentiates, in one place: the policy's loss and the critic's.

    L_policy = agg(ℓ) + β·agg(clamp(kl(logprobs, ref_logprobs), ±10)) − c·agg(H)
    L_value  = 0.5·agg(max((V_clip − G)², (V − G)²))

This file is the formula; every built-in term it calls is in
rlhf/plugins/algorithms/policy_losses.py, registered like a third party's:

* ℓ is the run's policy loss per token, the body of the method: ``ppo`` (the clipped surrogate,
  dual clip, mismatch corrections) or ``gspo`` (one ratio per sequence), or a plugin's.
* agg is the run's loss aggregation (``token_mean``, ...) over the counts of the whole optimizer
  step, so the gradient does not depend on how the step is split into micro-batches and ranks; a
  policy loss may declare its own for the ℓ term (``gspo``: per sequence).
* kl is the run's KL estimator (``k1``, ``k2``, ``k3``), on the policy's log-probs with grad,
  clamped to [-10, 10] here for every estimator; the term exists when KL goes into the loss with
  β > 0 (with KL in the reward, the advantages carry it and β here is 0).
  ``kl_unbiased_gradient`` keeps the estimator's value and gives it the importance-weighted
  score-function gradient of the reverse KL (`clamped_kl`).
* H is the entropy of the policy's next-token distribution (only when c > 0).
* Every mask is the *loss* mask: the action tokens of samples that count, so a sample skipped by
  the reward failure policy adds nothing.

`policy_training_loss` is the formula over resolved components; `PolicyTrainingLoss` and
`ValueTrainingLoss` hold a run's components (resolved once, by `rlhf.algorithms.resolve_algorithm`
with the run's plugin set) and compute one micro-batch's share of the step loss: the trained
workers call only them. ``rlhf.algorithms.policy_objective`` and friends (``losses.py``) resolve
names and call the same functions, for notebooks and tests.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf.algorithms.components import AlgorithmConfigError, ComponentRef, LoadedComponent, check_shape, load_component
from rlhf.core.errors import PluginError
from rlhf.core.types import LossNorm, PolicyLossInputs

if TYPE_CHECKING:
    import torch

    from rlhf.core.batch import ExperienceBatch
    from rlhf.core.plugin_host.loading import PluginSet

KL_CLAMP = 10.0  # every KL estimate is clamped to [-10, 10]
KL_IS_WEIGHT_CLIP = 10.0  # the importance weight of the unbiased KL gradient is clamped above at this


def policy_training_loss(*, loss: LoadedComponent, loss_config: Any, aggregation: LoadedComponent,
                         kl_estimator: LoadedComponent, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                         advantages: torch.Tensor, loss_mask: torch.Tensor, norm: LossNorm,
                         loss_aggregation: LoadedComponent | None = None, ref_logprobs: torch.Tensor | None = None,
                         kl_coef: float = 0.0, entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                         rollout_logprobs: torch.Tensor | None = None,
                         kl_unbiased_gradient: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
    """L = agg(ℓ) + β·agg(clamp(kl)) − c·agg(H) for one micro-batch: its share of the step loss.

    logprobs (B, A) with grad; old_logprobs, advantages, loss_mask, ref_logprobs, entropy (with
    grad), rollout_logprobs (B, A); ``norm`` the optimizer step's counts. ``loss_aggregation``: the
    aggregation of the ℓ term when the policy loss declares its own (gspo's), else ``aggregation``.
    Returns ``(loss (), metrics)``: the policy loss's metrics, plus ``policy/kl`` (token mean of the
    clamped KL) with the KL term and ``policy/entropy`` (token mean of H) with the entropy term.
    """
    from rlhf.core.masked import masked_mean

    if not kl_coef >= 0 or not entropy_coef >= 0:
        raise AlgorithmConfigError(f"kl_coef and entropy_coef must be >= 0, got {kl_coef} and {entropy_coef}")
    per_token, metrics = per_token_policy_loss(loss, loss_config, logprobs=logprobs, old_logprobs=old_logprobs,
                                               advantages=advantages, loss_mask=loss_mask,
                                               rollout_logprobs=rollout_logprobs)  # ℓ (B, A)
    total = aggregate(loss_aggregation or aggregation, per_token, loss_mask, norm)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise AlgorithmConfigError("the KL term of the loss (kl_coef > 0) needs the reference log-probs: "
                                       "pass ref_logprobs")
        kl = clamped_kl(kl_estimator, logprobs, ref_logprobs, mask=loss_mask, unbiased_gradient=kl_unbiased_gradient,
                        old_logprobs=old_logprobs)  # (B, A)
        total = total + kl_coef * aggregate(aggregation, kl, loss_mask, norm)
        metrics["policy/kl"] = masked_mean(kl.detach(), loss_mask)
    if entropy_coef > 0:
        if entropy is None:
            raise AlgorithmConfigError("the entropy bonus (entropy_coef > 0) needs the per-token entropy: "
                                       "pass entropy")
        total = total - entropy_coef * aggregate(aggregation, entropy, loss_mask, norm)
        metrics["policy/entropy"] = masked_mean(entropy.detach(), loss_mask)
    return total, metrics


def per_token_policy_loss(loss: LoadedComponent, config: Any, *, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                          advantages: torch.Tensor, loss_mask: torch.Tensor,
                          rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """ℓ (B, A), 0 off the loss mask, and its metrics: the registered policy loss, its output checked."""
    import torch

    shape = tuple(logprobs.shape)
    for arg, tensor in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask),
                        ("rollout_logprobs", rollout_logprobs)):
        if tensor is not None:
            check_shape(arg, tensor, shape)
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                              loss_mask=loss_mask.to(logprobs.dtype), rollout_logprobs=rollout_logprobs)
    result = loss.obj(inputs, config)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and tuple(result[0].shape) == shape):
        raise PluginError(f"policy loss {loss.name!r} must return (per_token_loss, metrics) with a loss of shape "
                          f"{shape}")
    return result[0], dict(result[1])


def loss_aggregation_of(loss: LoadedComponent, aggregation: ComponentRef, *,
                        plugins: PluginSet | None = None) -> LoadedComponent:
    """The aggregation of a policy loss's ℓ term: its own when it declares one (gspo's
    ``seq_mean_token_mean``), else ``aggregation`` (the run's)."""
    return load_component("loss_aggregation", loss.capabilities.get("aggregation") or aggregation, plugins=plugins)


def aggregate(aggregation: LoadedComponent, values: torch.Tensor, loss_mask: torch.Tensor,
              norm: LossNorm) -> torch.Tensor:
    """agg(values): this micro-batch's share of the step's aggregate. values, loss_mask (B, A) -> ()."""
    check_shape("loss_mask", loss_mask, tuple(values.shape))
    return aggregation.obj(values, loss_mask.to(values.dtype), norm)


def clamped_kl(estimator: LoadedComponent, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *,
               mask: torch.Tensor | None = None, unbiased_gradient: bool = False,
               old_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """kl(logprobs, ref_logprobs) per token, clamped to [-10, 10], 0 off ``mask``; differentiable in ``logprobs``.

    ``unbiased_gradient`` (OpenRLHF 0.11's ``compute_approx_kl(unbiased_gradient=True)``): the value
    stays the estimator's, but the gradient becomes the importance-weighted score-function gradient
    of the reverse KL, ∇ = w·δ·∇logprobs, δ = logprobs − ref_logprobs, w = min(exp(logprobs −
    old_logprobs), 10) detached (w = 1 without ``old_logprobs``), whatever the estimator:
    kl ← value.detach() + w·δ²/2 − (w·δ²/2).detach(). Samples come from the old policy, so
    E_old[w·δ·∇logprobs] = ∇ KL(π ‖ π_ref), which the plain estimators' pathwise gradients are not
    (k1's is 1 on every token). All (B, A); ``mask`` is the loss mask in the loss, the action mask
    for KL in the reward.
    """
    import torch

    check_shape("ref_logprobs", ref_logprobs, tuple(logprobs.shape))
    kl = estimator.obj(logprobs, ref_logprobs)  # (B, A)
    if not isinstance(kl, torch.Tensor) or kl.shape != logprobs.shape:
        raise PluginError(f"kl estimator {estimator.name!r} must return a tensor of shape {tuple(logprobs.shape)}")
    kl = kl.clamp(min=-KL_CLAMP, max=KL_CLAMP)  # (B, A)
    if unbiased_gradient:
        delta = logprobs.float() - ref_logprobs.float()  # (B, A)
        weight = 1.0
        if old_logprobs is not None:
            check_shape("old_logprobs", old_logprobs, tuple(logprobs.shape))
            weight = (logprobs.float() - old_logprobs.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()  # (B, A)
        surrogate = weight * delta.pow(2) / 2  # (B, A): its gradient is w·δ·∇logprobs
        kl = kl.detach() + surrogate - surrogate.detach()  # (B, A): the estimator's value, the surrogate's gradient
    if mask is not None:
        check_shape("mask", mask, tuple(logprobs.shape))
        kl = torch.where(mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))  # (B, A)
    return kl


def loss_norm(loss_mask: torch.Tensor, num_tokens: Any = None, num_sequences: Any = None,
              max_new_tokens: int | None = None) -> LossNorm:
    """Step-wide counts for the aggregations; those not given are counted from ``loss_mask``
    (B, A), which is then the whole step: loss tokens, and sequences with at least one."""
    mask = loss_mask.bool()  # (B, A)
    if num_tokens is None:
        num_tokens = float(mask.sum())
    if num_sequences is None:
        num_sequences = float(mask.any(dim=-1).sum())
    return LossNorm(num_tokens=num_tokens, num_sequences=num_sequences, max_new_tokens=max_new_tokens)


def step_norm(batch: ExperienceBatch, max_new_tokens: int | None) -> LossNorm:
    """The counts of one optimizer step's minibatch (all its rows, on every rank): loss tokens and
    sequences with at least one, over ``batch.loss_mask``."""
    return loss_norm(batch.loss_mask, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class PolicyTrainingLoss:
    """`policy_training_loss` with a run's components resolved, applied to a micro-batch.

    ``kl_coef`` is β of the KL term in the loss: 0 when KL goes into the reward or nowhere (an
    adaptive β is passed per step to the call). ``temperature`` is the sampling temperature the
    log-probs are computed at.
    """

    loss: LoadedComponent  # ℓ
    loss_config: Any
    loss_aggregation: LoadedComponent  # of the ℓ term: the loss's own (gspo's), else the run's
    aggregation: LoadedComponent  # the run's: the KL and entropy terms
    kl_estimator: LoadedComponent
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    kl_unbiased_gradient: bool = False

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0

    def __call__(self, logprobs: torch.Tensor, batch: ExperienceBatch, norm: LossNorm, *,
                 entropy: torch.Tensor | None = None,
                 kl_coef: float | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's share of the step loss. logprobs, entropy (b, A) from the training
        forward; ``batch`` the micro-batch; ``norm`` the step's counts (`step_norm`); ``kl_coef``
        this step's β when it is adaptive (used only when the loss has a KL term).

        Old log-probs missing means on-policy (one optimizer step per rollout): old = current,
        detached, so the ratio is 1 and its gradient the policy gradient.
        """
        old_logprobs = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        beta = self.kl_coef if kl_coef is None or self.kl_coef == 0 else kl_coef
        return policy_training_loss(
            loss=self.loss, loss_config=self.loss_config, aggregation=self.aggregation,
            loss_aggregation=self.loss_aggregation, kl_estimator=self.kl_estimator, logprobs=logprobs,
            old_logprobs=old_logprobs, advantages=batch.advantages, loss_mask=batch.loss_mask, norm=norm,
            ref_logprobs=batch.ref_logprobs, kl_coef=beta, entropy=entropy, entropy_coef=self.entropy_coef,
            rollout_logprobs=batch.rollout_logprobs, kl_unbiased_gradient=self.kl_unbiased_gradient)

    def logprob_gradient(self, batch: ExperienceBatch, norm: LossNorm, *,
                         kl_coef: float | None = None) -> torch.Tensor | None:
        """∂L/∂ℓ (b, A) of this loss on ``batch`` where it does not depend on the log-probs' values,
        else None: the gradient at two stand-in values of ℓ (0 and −1 at every position), kept where
        the two are equal to the bit. On-policy without a KL or entropy term the ratio is exactly 1
        at any ℓ, so the gradient is the advantage over the token counts. (A loss whose gradient
        varies with ℓ only elsewhere is still trained exactly: the caller checks the gradient it is
        handed.) Used to do the output layer's backward in its forward
        (`rlhf.core.logprobs.known_logprob_gradient`)."""
        import torch

        if self.needs_entropy:
            return None
        grads = []
        for value in (0.0, -1.0):
            standin = torch.full(batch.action_mask.shape, value, dtype=torch.float32,
                                 device=batch.action_mask.device, requires_grad=True)  # (b, A)
            with torch.enable_grad():
                loss, _ = self(standin, batch, norm, kl_coef=kl_coef)
                if not loss.requires_grad:
                    return None
                (grad,) = torch.autograd.grad(loss, standin, allow_unused=True)
            if grad is None:
                return None
            grads.append(grad)
        return grads[0] if torch.equal(grads[0], grads[1]) else None

    def trained_rows(self, batch: ExperienceBatch) -> torch.Tensor | None:
        """(B,) bool: the rows of ``batch`` that can add to the loss or its gradient; None when the
        loss cannot tell (every row trains).

        A row whose advantages are 0 on all its loss tokens adds exactly 0 to both when the policy
        loss is advantage-weighted (its registration says ``advantage_weighted``: ``ppo`` and
        ``gspo``, where every token's loss is its advantage times a finite factor), the aggregation
        of its ℓ term sums per-row terms over step-wide counts (``sums_rows``: every built-in one)
        and there is no KL or entropy term. GRPO / RLOO groups whose samples all scored the same
        are such rows; the trainer skips their forwards.
        """
        if self.kl_coef > 0 or self.entropy_coef > 0 or not self.loss.capabilities.get("advantage_weighted"):
            return None
        if not self.loss_aggregation.capabilities.get("sums_rows"):
            return None
        return ((batch.advantages != 0) & batch.loss_mask.bool()).any(dim=1)  # (B,)


@dataclass(frozen=True)
class ValueTrainingLoss:
    """The clipped value loss with a run's clip and aggregation, applied to a micro-batch."""

    aggregation: LoadedComponent
    clip: float | None = 0.5

    def __call__(self, values: torch.Tensor, batch: ExperienceBatch,
                 norm: LossNorm) -> tuple[torch.Tensor, dict[str, Any]]:
        """values (b, A) from the training forward: the value of the state before each action."""
        return value_training_loss(values=values, old_values=batch.values, returns=batch.returns,
                                   loss_mask=batch.loss_mask, norm=norm, aggregation=self.aggregation, clip=self.clip)


def clipped_value_error(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token max((V_clip − G)², (V − G)²), V_clip = V_old + clamp(V − V_old, −c, c), and where the
    clipped term is the larger. values (B, A) with grad; old_values, returns (B, A).

    Schulman et al. 2017 (arXiv:1707.06347) as OpenAI baselines' ``ppo2`` and OpenRLHF clip the
    critic: the new value may move at most ``clip`` from the value at rollout time, and the larger
    of the clipped and unclipped squared errors is kept. ``clip=None``: (V − G)².
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


def value_training_loss(*, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        loss_mask: torch.Tensor, norm: LossNorm, aggregation: LoadedComponent,
                        clip: float | None = 0.5) -> tuple[torch.Tensor, dict[str, Any]]:
    """L_V = 0.5·agg(max((V_clip − G)², (V − G)²)) (``clip=None``: 0.5·agg((V − G)²)).

    values (B, A) with grad; old_values, returns, loss_mask (B, A). Returns ``(loss (), metrics)`` with
    ``critic/clip_frac`` (share of tokens where the clipped error is the larger) and
    ``critic/values`` (mean value over action tokens).
    """
    from rlhf.core.masked import masked_mean

    if clip is not None and not clip > 0:
        raise AlgorithmConfigError(f"value clip must be positive (or None for no clipping), got {clip}")
    check_shape("loss_mask", loss_mask, tuple(values.shape))
    error, clipped = clipped_value_error(values, old_values, returns, clip)  # (B, A), (B, A)
    loss = 0.5 * aggregate(aggregation, error, loss_mask, norm)
    metrics = {
        "critic/clip_frac": masked_mean(clipped.to(error.dtype), loss_mask).detach(),
        "critic/values": masked_mean(values.detach(), loss_mask),
    }
    return loss, metrics
