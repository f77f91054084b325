"""What training differentiates: the policy objective and the value objective (docs/algorithms.md).

    L_policy = agg(ℓ) + β·agg(clamp(kl(logp, logp_ref), ±10)) − c·agg(H)
    L_value  = 0.5·agg(max((V_clip − G)², (V − G)²))

ℓ is the registered policy loss per token, ``agg`` the run's loss aggregation with the counts of
the whole optimizer step (so the gradient does not depend on how a step is split), kl the
registered KL estimator (the KL term only when KL goes into the loss, β > 0), H the entropy of
the policy's next-token distribution (only when c > 0). Every mask is the *loss* mask: action
tokens of samples that count, so a sample skipped by the reward failure policy adds nothing.

`policy_objective` is the formula as a function of tensors; `PolicyObjective` and
`ValueObjective` are the same, resolved once per run, taking a micro-batch: the trained workers
call only them, so the golden and property tests of these functions cover training itself.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf.algorithms.components import AlgorithmConfigError, ComponentRef, LoadedComponent, load_component
from rlhf.algorithms.losses import aggregate_loss, kl_divergence, loss_norm, policy_loss, value_loss
from rlhf.core.types import LossNorm

if TYPE_CHECKING:
    import torch

    from rlhf.core.batch import ExperienceBatch
    from rlhf.core.plugins import PluginSet


def policy_objective(name: ComponentRef = "ppo", *, logp: torch.Tensor, logp_old: torch.Tensor,
                     advantages: torch.Tensor, action_mask: torch.Tensor, ref_logp: torch.Tensor | None = None,
                     kl_estimator: ComponentRef = "k3", kl_coef: float = 0.0, entropy: torch.Tensor | None = None,
                     entropy_coef: float = 0.0, aggregation: ComponentRef = "token_mean",
                     num_tokens: float | None = None, num_sequences: float | None = None,
                     max_new_tokens: int | None = None, rollout_logp: torch.Tensor | None = None,
                     kl_unbiased_gradient: bool = False, config: Any = None,
                     plugins: PluginSet | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The policy's loss for one micro-batch: agg(ℓ) + β·agg(clamp(kl)) − c·agg(H).

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
    from rlhf.core.masked import masked_mean

    if not kl_coef >= 0 or not entropy_coef >= 0:
        raise AlgorithmConfigError(f"kl_coef and entropy_coef must be >= 0, got {kl_coef} and {entropy_coef}")
    aggregation = load_component("loss_aggregation", aggregation, plugins=plugins)
    counts = {"num_tokens": num_tokens, "num_sequences": num_sequences, "max_new_tokens": max_new_tokens}
    loss, metrics = policy_loss(name, logp=logp, logp_old=logp_old, advantages=advantages,
                                action_mask=action_mask, rollout_logp=rollout_logp, aggregation=aggregation,
                                config=config, plugins=plugins, **counts)
    if kl_coef > 0:
        if ref_logp is None:
            raise AlgorithmConfigError("the KL term of the loss (kl_coef > 0) needs the reference log-probs: "
                                       "pass ref_logp")
        kl = kl_divergence(kl_estimator, logp, ref_logp, action_mask=action_mask, plugins=plugins,
                           unbiased_gradient=kl_unbiased_gradient, logp_old=logp_old)  # (B, A)
        loss = loss + kl_coef * aggregate_loss(aggregation, kl, action_mask, **counts)
        metrics["policy/kl"] = masked_mean(kl.detach(), action_mask)
    if entropy_coef > 0:
        if entropy is None:
            raise AlgorithmConfigError("the entropy bonus (entropy_coef > 0) needs the per-token entropy: "
                                       "pass entropy")
        loss = loss - entropy_coef * aggregate_loss(aggregation, entropy, action_mask, **counts)
        metrics["policy/entropy"] = masked_mean(entropy.detach(), action_mask)
    return loss, metrics


def step_norm(batch: ExperienceBatch, max_new_tokens: int | None) -> LossNorm:
    """The counts of one optimizer step's minibatch (all its rows, on every rank): loss tokens and
    sequences with at least one, over ``batch.loss_mask``."""
    return loss_norm(batch.loss_mask, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class PolicyObjective:
    """`policy_objective` with a run's components resolved, applied to a micro-batch.

    ``kl_coef`` is β of the KL term in the loss: 0 when KL goes into the reward or nowhere
    (an adaptive β is passed per step to `loss`). ``temperature`` is the sampling temperature the
    log-probs are computed at.
    """

    policy_loss: LoadedComponent
    policy_loss_config: Any
    aggregation: LoadedComponent
    kl_estimator: LoadedComponent
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    kl_unbiased_gradient: bool = False

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0

    def trained_rows(self, batch: ExperienceBatch) -> torch.Tensor | None:
        """(B,) bool: the rows of ``batch`` that can add to the loss or its gradient; None when the
        objective cannot tell (every row trains).

        A row whose advantages are 0 on all its loss tokens adds exactly 0 to both when the policy
        loss is advantage-weighted (its registration says ``advantage_weighted``: ``ppo`` and
        ``gspo``, where every token's loss is its advantage times a finite factor), the loss's
        aggregation sums per-row terms over step-wide counts (``sums_rows``: every built-in one)
        and there is no KL or entropy term. GRPO / RLOO groups whose samples all scored the same
        are such rows; the trainer skips their forwards.
        """
        if self.kl_coef > 0 or self.entropy_coef > 0 or not self.policy_loss.capabilities.get("advantage_weighted"):
            return None
        own = self.policy_loss.capabilities.get("aggregation")  # resolved as `policy_loss` resolves it
        aggregation = load_component("loss_aggregation", own) if own else self.aggregation
        if not aggregation.capabilities.get("sums_rows"):
            return None
        return ((batch.advantages != 0) & batch.loss_mask.bool()).any(dim=1)  # (B,)

    def loss(self, logprobs: torch.Tensor, batch: ExperienceBatch, norm: LossNorm, *,
             entropy: torch.Tensor | None = None, kl_coef: float | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's share of the step loss. logprobs, entropy (b, A) from the training
        forward; ``batch`` the micro-batch; ``norm`` the step's counts (`step_norm`); ``kl_coef``
        this step's β when it is adaptive (used only when the objective has a KL term).

        Old log-probs missing means on-policy (one optimizer step per rollout): old = current,
        detached, so the ratio is 1 and its gradient the policy gradient.
        """
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        return policy_objective(
            self.policy_loss, logp=logprobs, logp_old=old, advantages=batch.advantages, action_mask=batch.loss_mask,
            ref_logp=batch.ref_logprobs, kl_estimator=self.kl_estimator,
            kl_coef=self.kl_coef if kl_coef is None or self.kl_coef == 0 else kl_coef, entropy=entropy,
            entropy_coef=self.entropy_coef, aggregation=self.aggregation, num_tokens=norm.num_tokens,
            num_sequences=norm.num_sequences, max_new_tokens=norm.max_new_tokens,
            rollout_logp=batch.rollout_logprobs, kl_unbiased_gradient=self.kl_unbiased_gradient,
            config=self.policy_loss_config)


@dataclass(frozen=True)
class ValueObjective:
    """`value_loss` with a run's clip and aggregation, applied to a micro-batch."""

    aggregation: LoadedComponent
    clip: float | None = 0.5

    def loss(self, values: torch.Tensor, batch: ExperienceBatch, norm: LossNorm) -> tuple[torch.Tensor, dict[str, Any]]:
        """values (b, A) from the training forward: the value of the state before each action."""
        return value_loss(values=values, old_values=batch.values, returns=batch.returns, action_mask=batch.loss_mask,
                          clip=self.clip, aggregation=self.aggregation, num_tokens=norm.num_tokens,
                          num_sequences=norm.num_sequences, max_new_tokens=norm.max_new_tokens)
