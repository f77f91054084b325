"""The algorithm math as plain functions, for the trainer, plugins, notebooks and tests (DESIGN §6).

Every function takes the component to use as its first argument: a registered name (``"grpo"``,
``"k3"``, ``"ppo"``, ``"token_mean"``), a ``"module.path:attr"`` or ``"file.py:attr"`` reference,
a `LoadedComponent` (what `resolve_algorithm` returns, so a run resolves names once), or the
function itself. Names resolve through the registries, so a third-party estimator registered by
a plugin is usable here by its name. ``plugins`` is the `PluginSet` to resolve names in; when
None, one built with ``build_plugin_manager()`` on first use (never at import) is kept for the
process.

Example::

    import torch
    from rlhf.algorithms import compute_advantages, policy_loss

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])            # (B,) one prompt, n = 4 samples
    action_mask = torch.ones(4, 3)                          # (B, A)
    advantages, returns = compute_advantages("grpo", rewards=rewards, action_mask=action_mask,
                                             group_size=4)  # advantages[:, 0] = [1.5, -.5, -.5, -.5]
    logprobs = torch.zeros(4, 3, requires_grad=True)
    loss, metrics = policy_loss("ppo", logp=logprobs, logp_old=logprobs.detach(),
                                advantages=advantages, action_mask=action_mask)

Shape legend: ``B`` sequences (the n samples of a prompt are contiguous rows), ``A`` action
positions (``T - 1``: position t holds the log-prob of token t+1), ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from rlhf.core.errors import ConfigError, PluginError
from rlhf.core.kinds import get_kind
from rlhf.core.references import import_object, is_reference
from rlhf.core.types import AdvantageConfig, AdvantageInputs, AlgorithmPreset, LossNorm, PolicyLossInputs

if TYPE_CHECKING:
    import torch

    from rlhf.core.plugins import PluginSet

__all__ = [
    "KL_CLAMP", "KL_PLACEMENTS", "AlgorithmConfigError", "LoadedComponent", "ResolvedAlgorithm",
    "aggregate_loss", "compute_advantages", "entropy_from_logits", "kl_divergence", "load_component",
    "policy_loss", "resolve_algorithm", "value_loss",
]

KL_CLAMP = 10.0  # every KL estimate is clamped to [-10, 10]
KL_PLACEMENTS = ("reward", "loss", "none")


class AlgorithmConfigError(ConfigError):
    """An algorithm setting that cannot work (wrong value, or a combination that contradicts itself)."""


# --- resolving components -------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedComponent:
    """One resolved component: its name, the object, its config class and capability flags.

    Calling it calls the object, so ``component(inputs, config)`` works for an estimator.
    """

    kind: str  # "advantage_estimator", "policy_loss", "kl_estimator", "loss_aggregation", "algorithm"
    name: str  # the registered name, or the reference the user typed
    obj: Any
    config_cls: type | None = None
    capabilities: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.obj(*args, **kwargs)


ComponentRef = Union[str, LoadedComponent, Callable[..., Any]]

_default_plugins: PluginSet | None = None


def _plugin_set(plugins: PluginSet | None) -> PluginSet:
    global _default_plugins
    if plugins is not None:
        return plugins
    if _default_plugins is None:
        from rlhf.core.plugins import build_plugin_manager

        _default_plugins = build_plugin_manager()
    return _default_plugins


def load_component(kind: str, ref: ComponentRef, *, plugins: PluginSet | None = None) -> LoadedComponent:
    """Resolve a name, a ``module:attr`` / ``file.py:attr`` reference or an object to a `LoadedComponent`.

    Raises `UnknownComponentError` (with close names) for an unknown name. An object or reference
    that is not registered declares its flags and config class as attributes (``needs_critic``,
    ``needs_groups``, ``config_cls``), or gets the kind's defaults.
    """
    spec = get_kind(kind)
    if isinstance(ref, LoadedComponent):
        if ref.kind != kind:
            raise AlgorithmConfigError(f"{ref.name!r} is a {ref.kind.replace('_', ' ')}, not a {spec.title}")
        return ref
    if isinstance(ref, str) and not is_reference(ref):
        component = _plugin_set(plugins).registry(kind).component(ref)
        return LoadedComponent(kind, component.name, component.load(), component.load_config_cls(),
                               dict(component.capabilities))
    obj = import_object(ref) if isinstance(ref, str) else ref
    problem = spec.check(obj)
    if problem:
        raise PluginError(f"{spec.title} {ref!r} should be {problem}, got {type(obj).__name__}")
    name = ref if isinstance(ref, str) else getattr(obj, "__name__", type(obj).__name__)
    capabilities = {flag: getattr(obj, flag, default) for flag, default in spec.capabilities.items()}
    return LoadedComponent(kind, name, obj, getattr(obj, "config_cls", None), capabilities)


def _build_config(component: LoadedComponent, base: type | None, settings: dict[str, Any],
                  defaults: dict[str, Any], config: Any) -> Any:
    """The config object for one call: ``config`` as given, or the component's config class built
    from ``settings``. A setting the class lacks is an error unless it is left at its default."""
    if config is not None:
        changed = [k for k, v in settings.items() if v != defaults[k]]
        if changed:
            raise AlgorithmConfigError(f"pass either config= or {', '.join(changed)}, not both")
        return config
    config_cls = component.config_cls or base
    fields = {f.name for f in dataclasses.fields(config_cls)} if config_cls is not None else set()
    unsupported = [k for k, v in settings.items() if k not in fields and v != defaults[k]]
    if unsupported:
        raise AlgorithmConfigError(
            f"{component.kind.replace('_', ' ')} {component.name!r} has no setting "
            f"{', '.join(unsupported)}; its settings: {', '.join(sorted(fields)) or 'none'}"
        )
    if config_cls is None:
        return None
    return config_cls(**{k: v for k, v in settings.items() if k in fields})


def _check_shape(name: str, tensor: Any, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def _float_dtype(*tensors: Any) -> torch.dtype:
    import torch

    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None and tensor.dtype == torch.float64:
            dtype = torch.float64
    return dtype


# --- advantages -----------------------------------------------------------------------------

_ADVANTAGE_DEFAULTS = {"gamma": 1.0, "lambd": 1.0, "std_norm": True, "reward_clip": 10.0}


def compute_advantages(estimator: ComponentRef, *, rewards: torch.Tensor, action_mask: torch.Tensor,
                       group_size: int, values: torch.Tensor | None = None, kl: torch.Tensor | None = None,
                       kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0, std_norm: bool = True,
                       reward_clip: float | None = 10.0, sample_mask: torch.Tensor | None = None,
                       config: AdvantageConfig | None = None,
                       plugins: PluginSet | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns of one rollout batch.

    Shaped sequence reward r̃ (per estimator: r, r - mean(group), r - mean(others),
    (r - mean(group)) / (std(group) + 1e-9)), clipped to [-reward_clip, reward_clip]; per-token
    reward R_t = -β·kl_t + [t = last action token]·r̃; returns G_t = m_t R_t + γ G_{t+1} (γ = 1
    for group estimators) or GAE; token-weighted whitening for gae / reinforce_pp /
    reinforce_pp_baseline, Â ← (Â - μ) / sqrt(max(σ², 1e-8)) (``std_norm=False``: Â - μ).

    rewards (B,) sequence rewards; action_mask (B, A) 1 where the policy generated the token;
    values (B, A) critic values (estimators that need a critic); kl (B, A) per-token KL to put in
    the reward with coefficient ``kl_coef`` (β), None when KL is in the loss; sample_mask (B,)
    1 = valid, 0 = left out of group statistics and whitening, advantage and return 0. Rows are
    grouped contiguously by prompt, ``group_size`` (n) rows per prompt. ``config`` replaces
    gamma / lambd / std_norm / reward_clip with a ready-made `AdvantageConfig`.
    Returns ``(advantages (B, A), returns (B, A))``, 0 where the action mask is 0.
    """
    import torch

    component = load_component("advantage_estimator", estimator, plugins=plugins)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), one reward per sequence; got shape {tuple(rewards.shape)}")
    batch_size = rewards.size(0)
    if action_mask.dim() != 2 or action_mask.size(0) != batch_size:
        raise ValueError(f"action_mask must be (B, A) with B = {batch_size}; got {tuple(action_mask.shape)}")
    for name, tensor in (("values", values), ("kl", kl)):
        if tensor is not None:
            _check_shape(name, tensor, tuple(action_mask.shape))
    if sample_mask is not None:
        _check_shape("sample_mask", sample_mask, (batch_size,))
    if not isinstance(group_size, int) or group_size < 1 or batch_size % group_size:
        raise ValueError(f"group_size must be a positive divisor of the batch size {batch_size}, got {group_size!r}")
    if component.capabilities.get("needs_groups") and group_size < 2:
        raise AlgorithmConfigError(_groups_message(component.name, group_size))
    if component.capabilities.get("needs_critic") and values is None:
        raise AlgorithmConfigError(f"advantage estimator {component.name!r} needs critic values: pass values=")
    if not kl_coef >= 0:
        raise AlgorithmConfigError(f"kl_coef (β) must be >= 0, got {kl_coef}")
    settings = {"gamma": gamma, "lambd": lambd, "std_norm": std_norm, "reward_clip": reward_clip}
    config = _build_config(component, AdvantageConfig, settings, _ADVANTAGE_DEFAULTS, config)

    dtype = _float_dtype(rewards, values, kl)
    inputs = AdvantageInputs(
        rewards=rewards.to(dtype), action_mask=action_mask.to(dtype),
        kl=None if kl is None else kl.to(dtype), kl_coef=float(kl_coef),
        values=None if values is None else values.to(dtype), group_size=group_size,
        sample_mask=None if sample_mask is None else sample_mask.bool(),
    )
    with torch.no_grad():
        result = component(inputs, config)
    if not (isinstance(result, tuple) and len(result) == 2
            and all(isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(action_mask.shape) for t in result)):
        raise PluginError(f"advantage estimator {component.name!r} must return (advantages, returns), "
                          f"two tensors of shape {tuple(action_mask.shape)}")
    return result


def _groups_message(name: str, n_samples: int) -> str:
    return (f"advantage estimator {name!r} compares samples of the same prompt: set --n-samples to 2 "
            f"or more (got {n_samples})")


# --- KL, losses -----------------------------------------------------------------------------


def kl_divergence(estimator: ComponentRef, logp: torch.Tensor, logp_ref: torch.Tensor, *,
                  action_mask: torch.Tensor | None = None, plugins: PluginSet | None = None) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, clamped to [-10, 10].

    With δ = logp - logp_ref: k1 = δ, k2 = δ²/2, k3 = exp(-δ) - 1 + δ. logp, logp_ref (B, A);
    action_mask (B, A) optional, zeroes masked positions. Returns (B, A).
    """
    import torch

    component = load_component("kl_estimator", estimator, plugins=plugins)
    _check_shape("logp_ref", logp_ref, tuple(logp.shape))
    kl = component(logp, logp_ref)  # (B, A)
    if not isinstance(kl, torch.Tensor) or kl.shape != logp.shape:
        raise PluginError(f"kl estimator {component.name!r} must return a tensor of shape {tuple(logp.shape)}")
    kl = kl.clamp(min=-KL_CLAMP, max=KL_CLAMP)  # (B, A)
    if action_mask is not None:
        _check_shape("action_mask", action_mask, tuple(logp.shape))
        kl = torch.where(action_mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))  # (B, A)
    return kl


def _loss_norm(action_mask: torch.Tensor, num_tokens: Any, num_sequences: Any, max_new_tokens: int | None) -> LossNorm:
    """Step-wide counts; those not given are counted from this batch (then the batch is the step)."""
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
    _check_shape("action_mask", action_mask, tuple(loss.shape))
    return component(loss, action_mask.to(loss.dtype), _loss_norm(action_mask, num_tokens, num_sequences, max_new_tokens))


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
    logp_rollout), lo, hi)·ℓ, "icepop": the same weight unclamped but 0 outside [lo, hi] (detached).

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
            _check_shape(arg, tensor, shape)
    settings = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip, "correction": correction,
                "correction_bounds": tuple(correction_bounds)}
    config = _build_config(component, None, settings, _POLICY_DEFAULTS, config)
    mask = action_mask.to(logp.dtype)  # (B, A)
    inputs = PolicyLossInputs(logprobs=logp, old_logprobs=logp_old, advantages=advantages, action_mask=mask,
                              rollout_logprobs=rollout_logp)
    result = component(inputs, config)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and tuple(result[0].shape) == shape):
        raise PluginError(f"policy loss {component.name!r} must return (per_token_loss, metrics) with a "
                          f"loss of shape {shape}")
    per_token_loss, metrics = result
    loss = aggregate_loss(aggregation, per_token_loss, mask, num_tokens=num_tokens, num_sequences=num_sequences,
                          max_new_tokens=max_new_tokens, plugins=plugins)
    return loss, dict(metrics)


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
    from rlhf.plugins.algorithms.masked import masked_mean
    from rlhf.plugins.algorithms.value_loss import clipped_value_error

    if clip is not None and not clip > 0:
        raise AlgorithmConfigError(f"value clip must be positive (or None for no clipping), got {clip}")
    _check_shape("action_mask", action_mask, tuple(values.shape))
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

    The trainer subtracts ``entropy_coef · agg(H)`` from the policy loss.
    """
    from rlhf.plugins.algorithms.entropy import entropy_from_logits as entropy

    return entropy(logits)


# --- presets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """What a run uses, resolved and validated before it starts (see `resolve_algorithm`).

    Each component is a `LoadedComponent`: ``.name`` for logs and configs, callable as the
    registered object, and accepted by the functions of this module in place of a name.
    """

    algo: str
    advantage: LoadedComponent
    policy_loss: LoadedComponent
    kl_estimator: LoadedComponent
    loss_agg: LoadedComponent
    kl_in: str  # "reward", "loss" or "none": KL goes to exactly one place
    kl_coef: float  # β
    n_samples: int
    needs_critic: bool  # build a critic and pass values to compute_advantages
    needs_groups: bool  # the estimator compares the n samples of a prompt
    needs_reference: bool  # a reference model is needed (KL is used and β > 0)

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
    needs_groups = bool(estimator.capabilities.get("needs_groups"))
    if needs_groups and n_samples < 2:
        raise AlgorithmConfigError(_groups_message(estimator.name, n_samples))
    return ResolvedAlgorithm(
        algo=preset_component.name, advantage=estimator, policy_loss=loss, kl_estimator=kl, loss_agg=aggregation,
        kl_in=kl_in, kl_coef=float(kl_coef), n_samples=n_samples,
        needs_critic=bool(estimator.capabilities.get("needs_critic")), needs_groups=needs_groups,
        needs_reference=kl_in != "none" and kl_coef > 0,
    )
