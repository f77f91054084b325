"""`resolve_algorithm`: ``--algo`` and its overrides, resolved and checked before a run starts.

The result, `ResolvedAlgorithm`, is what a run uses: its components (resolved once, accepted by
every function of `rlhf.algorithms` in place of a name), where KL goes, and what the run must
build (a critic, a reference model) or compute (old log-probs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf.algorithms.advantages import groups_message
from rlhf.algorithms.components import AlgorithmConfigError, ComponentRef, LoadedComponent, load_component
from rlhf.algorithms.training_loss import PolicyTrainingLoss, ValueTrainingLoss, loss_aggregation_of
from rlhf.core.types import AdvantageConfig, AlgorithmPreset

if TYPE_CHECKING:
    from rlhf.core.plugin_host.loading import PluginSet

KL_PLACEMENTS = ("reward", "loss", "none")


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """What a run uses, resolved and validated before it starts (see `resolve_algorithm`).

    Each component is a `LoadedComponent`: ``.name`` for logs and configs, callable as the
    registered object, and accepted by the functions of `rlhf.algorithms` in place of a name.
    """

    algo: str
    advantage: LoadedComponent
    policy_loss: LoadedComponent
    kl_estimator: LoadedComponent
    loss_agg: LoadedComponent
    policy_loss_agg: LoadedComponent  # the aggregation of the ℓ term: the loss's own (gspo's), else loss_agg
    kl_in: str  # "reward", "loss" or "none": KL goes to exactly one place
    kl_coef: float  # β
    n_samples: int
    needs_critic: bool  # build a critic and pass values to compute_advantages
    needs_groups: bool  # the estimator compares the n samples of a prompt
    needs_reference: bool  # a reference model is needed (KL is used and β > 0)
    needs_teacher: bool = False  # the preset distils a teacher: --teacher is required (rlhf.algorithms.distillation)

    @property
    def kl_in_loss(self) -> bool:
        """The policy's loss has a KL term (β > 0, KL placed in the loss)."""
        return self.kl_in == "loss" and self.kl_coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """The per-token reward carries -β·kl (β > 0, KL placed in the reward)."""
        return self.kl_in == "reward" and self.kl_coef > 0

    def needs_old_logprobs(self, optimizer_steps_per_rollout: int) -> bool:
        """Whether the old log-probs need a forward pass of their own. With one optimizer step per
        rollout they equal the training forward's (detached), unless KL in the reward needs them
        before any training forward."""
        return optimizer_steps_per_rollout > 1 or self.kl_in_reward

    def needs_rollout_logprobs(self, policy_loss_config: Any) -> bool:
        """Whether the policy loss reads the rollout engine's log-probs with this config (the loss's
        ``needs_rollout_logprobs`` flag: a bool, or a function of its config)."""
        flag = self.policy_loss.capabilities.get("needs_rollout_logprobs", False)
        return bool(flag(policy_loss_config) if callable(flag) else flag)

    def policy_training_loss(self, policy_loss_config: Any, *, entropy_coef: float = 0.0, temperature: float = 1.0,
                             kl_unbiased_gradient: bool = False) -> PolicyTrainingLoss:
        """The run's policy loss (`rlhf.algorithms.training_loss`); ``policy_loss_config`` is the policy
        loss's own config object."""
        if kl_unbiased_gradient and not self.kl_in_loss:
            raise AlgorithmConfigError("--kl-unbiased-gradient changes the gradient of the KL term of the loss, and "
                                       f"this run has none (KL in {self.kl_in}, β {self.kl_coef}): use --kl-in loss "
                                       "with --kl-coef > 0, or drop the flag")
        return PolicyTrainingLoss(loss=self.policy_loss, loss_config=policy_loss_config,
                                  loss_aggregation=self.policy_loss_agg, aggregation=self.loss_agg,
                                  kl_estimator=self.kl_estimator, kl_coef=self.kl_coef if self.kl_in_loss else 0.0,
                                  entropy_coef=entropy_coef, temperature=temperature,
                                  kl_unbiased_gradient=kl_unbiased_gradient)

    def value_training_loss(self, clip: float | None = 0.5) -> ValueTrainingLoss:
        """The critic's loss: the clipped value loss with the run's loss aggregation."""
        if clip is not None and not clip > 0:
            raise AlgorithmConfigError(f"--value-clip must be positive (or None for no clipping), got {clip}")
        return ValueTrainingLoss(aggregation=self.loss_agg, clip=clip)

    # The registered objects themselves, for a trainer that calls them directly (raw: the KL
    # estimator is not clamped, the policy loss is per token).
    @property
    def advantage_fn(self) -> Callable[..., Any]:
        return self.advantage.obj

    @property
    def advantage_config_cls(self) -> type:
        return self.advantage.config_cls or AdvantageConfig

    @property
    def policy_loss_fn(self) -> Callable[..., Any]:
        return self.policy_loss.obj

    @property
    def policy_loss_config_cls(self) -> type | None:
        return self.policy_loss.config_cls

    @property
    def kl_estimator_fn(self) -> Callable[..., Any]:
        return self.kl_estimator.obj

    @property
    def aggregate_fn(self) -> Callable[..., Any]:
        return self.loss_agg.obj

    def names(self) -> dict[str, Any]:
        """The resolved choices as plain values, for the run config and logs."""
        return {"algo": self.algo, "advantage": self.advantage.name, "policy_loss": self.policy_loss.name,
                "kl_estimator": self.kl_estimator.name, "kl_in": self.kl_in, "kl_coef": self.kl_coef,
                "loss_agg": self.loss_agg.name}


def resolve_algorithm(algo: ComponentRef = "grpo", *, advantage: ComponentRef | None = None,
                      policy_loss: ComponentRef | None = None, kl_estimator: ComponentRef | None = None,
                      kl_coef: float | None = None, kl_in: str | None = None, loss_agg: ComponentRef | None = None,
                      n_samples: int, plugins: PluginSet | None = None) -> ResolvedAlgorithm:
    """Resolve ``--algo`` and its overrides into a `ResolvedAlgorithm`, checking that they work together.

    Each override left as None takes the preset's value. Raises `UnknownComponentError` for an
    unknown name (with close names) and `AlgorithmConfigError` for a bad combination: a group
    estimator with ``n_samples < 2``, ``kl_in`` not one of reward / loss / none, a negative β.
    """
    preset_component = load_component("algorithm", algo, plugins=plugins)
    preset: AlgorithmPreset = preset_component.obj
    kl_in = preset.kl_in if kl_in is None else kl_in
    if kl_in not in KL_PLACEMENTS:
        raise AlgorithmConfigError(f"--kl-in must be one of {', '.join(KL_PLACEMENTS)} (got {kl_in!r})")
    kl_coef = preset.kl_coef if kl_coef is None else kl_coef
    if not (isinstance(kl_coef, (int, float)) and kl_coef >= 0):
        raise AlgorithmConfigError(f"--kl-coef must be a number >= 0 (got {kl_coef!r})")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise AlgorithmConfigError(f"--n-samples must be a positive integer (got {n_samples!r})")

    estimator = load_component("advantage_estimator", advantage or preset.advantage, plugins=plugins)
    loss = load_component("policy_loss", policy_loss or preset.policy_loss, plugins=plugins)
    kl = load_component("kl_estimator", kl_estimator or preset.kl_estimator, plugins=plugins)
    aggregation = load_component("loss_aggregation", loss_agg or preset.loss_agg, plugins=plugins)
    loss_aggregation = loss_aggregation_of(loss, aggregation, plugins=plugins)
    needs_groups = bool(estimator.capabilities.get("needs_groups"))
    if needs_groups and n_samples < 2:
        raise AlgorithmConfigError(groups_message(estimator.name, n_samples))
    return ResolvedAlgorithm(
        algo=preset_component.name, advantage=estimator, policy_loss=loss, kl_estimator=kl, loss_agg=aggregation,
        policy_loss_agg=loss_aggregation,
        kl_in=kl_in, kl_coef=float(kl_coef), n_samples=n_samples,
        needs_critic=bool(estimator.capabilities.get("needs_critic")), needs_groups=needs_groups,
        needs_reference=kl_in != "none" and kl_coef > 0, needs_teacher=bool(preset.needs_teacher),
    )
