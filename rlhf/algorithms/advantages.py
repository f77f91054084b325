"""`compute_advantages`: any registered advantage estimator, with its inputs checked (docs/algorithms.md).

Shape legend: ``B`` sequences (the n samples of a prompt are contiguous rows), ``A`` action positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.algorithms.components import (AlgorithmConfigError, ComponentRef, LoadedComponent, build_config, check_shape,
                                        float_dtype, load_component)
from rlhf.core.errors import PluginError
from rlhf.core.types import AdvantageConfig, AdvantageInputs

if TYPE_CHECKING:
    import torch

    from rlhf.core.plugin_host.loading import PluginSet

_ADVANTAGE_DEFAULTS = {"gamma": 1.0, "lambd": 1.0, "std_norm": True, "reward_clip": 10.0}


def compute_advantages(estimator: ComponentRef, *, rewards: torch.Tensor, action_mask: torch.Tensor,
                       group_size: int, values: torch.Tensor | None = None, kl: torch.Tensor | None = None,
                       kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0, std_norm: bool = True,
                       reward_clip: float | None = 10.0, sample_mask: torch.Tensor | None = None,
                       source_rewards: dict[str, torch.Tensor] | None = None,
                       metadata: list[dict[str, Any]] | None = None, config: AdvantageConfig | None = None,
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
    ``source_rewards`` ({name: (B,)}) and ``metadata`` (one dict per row) reach the estimator as
    ``inputs.source_rewards`` / ``inputs.metadata``, for estimators that treat sources or rows
    differently (built-in estimators ignore them).
    Returns ``(advantages (B, A), returns (B, A))``, 0 where the action mask is 0.
    """
    import torch

    component = load_component("advantage_estimator", estimator, plugins=plugins)
    inputs = advantage_inputs(component, rewards=rewards, action_mask=action_mask, group_size=group_size,
                              values=values, kl=kl, kl_coef=kl_coef, sample_mask=sample_mask,
                              source_rewards=source_rewards, metadata=metadata)
    settings = {"gamma": gamma, "lambd": lambd, "std_norm": std_norm, "reward_clip": reward_clip}
    config = build_config(component, AdvantageConfig, settings, _ADVANTAGE_DEFAULTS, config)
    with torch.no_grad():
        result = component.obj(inputs, config)
    return checked_advantages(component, result, tuple(action_mask.shape))


def default_config(component: LoadedComponent) -> Any:
    """The config object ``component`` (an advantage estimator) gets when no setting is changed."""
    return build_config(component, AdvantageConfig, dict(_ADVANTAGE_DEFAULTS), _ADVANTAGE_DEFAULTS, None)


def advantage_inputs(component: LoadedComponent, *, rewards: torch.Tensor, action_mask: torch.Tensor,
                     group_size: int, values: torch.Tensor | None = None, kl: torch.Tensor | None = None,
                     kl_coef: float = 0.0, sample_mask: torch.Tensor | None = None,
                     source_rewards: dict[str, torch.Tensor] | None = None,
                     metadata: list[dict[str, Any]] | None = None) -> AdvantageInputs:
    """What ``component`` (an advantage estimator) is called with, every shape and its needs
    (groups, a critic) checked; tensors in float32, or float64 when an input is."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), one reward per sequence; got shape {tuple(rewards.shape)}")
    batch_size = rewards.size(0)
    if action_mask.dim() != 2 or action_mask.size(0) != batch_size:
        raise ValueError(f"action_mask must be (B, A) with B = {batch_size}; got {tuple(action_mask.shape)}")
    for name, tensor in (("values", values), ("kl", kl)):
        if tensor is not None:
            check_shape(name, tensor, tuple(action_mask.shape))
    if sample_mask is not None:
        check_shape("sample_mask", sample_mask, (batch_size,))
    for name, per_source in (source_rewards or {}).items():
        check_shape(f"source_rewards[{name!r}]", per_source, (batch_size,))
    if metadata is not None and len(metadata) != batch_size:
        raise ValueError(f"metadata must hold one dict per row ({batch_size}), got {len(metadata)}")
    if not isinstance(group_size, int) or group_size < 1 or batch_size % group_size:
        raise ValueError(f"group_size must be a positive divisor of the batch size {batch_size}, got {group_size!r}")
    if component.capabilities.get("needs_groups") and group_size < 2:
        raise AlgorithmConfigError(groups_message(component.name, group_size))
    if component.capabilities.get("needs_critic") and values is None:
        raise AlgorithmConfigError(f"advantage estimator {component.name!r} needs critic values: pass values=")
    if not kl_coef >= 0:
        raise AlgorithmConfigError(f"kl_coef (β) must be >= 0, got {kl_coef}")
    dtype = float_dtype(rewards, values, kl)
    return AdvantageInputs(
        rewards=rewards.to(dtype), action_mask=action_mask.to(dtype),
        kl=None if kl is None else kl.to(dtype), kl_coef=float(kl_coef),
        values=None if values is None else values.to(dtype), group_size=group_size,
        sample_mask=None if sample_mask is None else sample_mask.bool(),
        source_rewards={name: per_source.to(dtype) for name, per_source in (source_rewards or {}).items()},
        metadata=list(metadata or []),
    )


def checked_advantages(component: LoadedComponent, result: Any,
                       shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``result`` of the estimator ``component``, if it is (advantages, returns), two tensors of ``shape`` (B, A)."""
    import torch

    if not (isinstance(result, tuple) and len(result) == 2
            and all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for t in result)):
        raise PluginError(f"advantage estimator {component.name!r} must return (advantages, returns), "
                          f"two tensors of shape {shape}")
    return result


def groups_message(name: str, n_samples: int) -> str:
    return (f"advantage estimator {name!r} compares samples of the same prompt: set --n-samples to 2 "
            f"or more (got {n_samples})")
