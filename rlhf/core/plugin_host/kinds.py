"""The kinds of component a plugin can register, one registration hook each.

A kind fixes the hook that fills it, the capability flags a registration may carry (with
their defaults) and what the registered object must be: for engines, backends, model
adapters and objectives, a class implementing the written protocol
(``rlhf.core.protocols.rollout.RolloutEngine``, ``rlhf.core.protocols.backend.TrainBackend``,
``rlhf.core.protocols.adapter.ModelAdapter``, ``rlhf.core.protocols.objective.Objective``), checked when the class
is registered (or first used, when registered by ``"module:attr"`` reference).

Some capabilities promise more: a flag in ``promises`` that a registration sets true makes the
class implement one more protocol (``continuous_batching=True``: `ContinuousEngine`), and a
flag in ``setting_capabilities`` names one of the component's settings (a field of its
``config_cls``: ``sharding_setting="zero_stage"``), both checked with the registration. The host
then decides what a component can do from its capabilities alone (docs/architecture.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable


def _callable(obj: Any) -> str | None:
    return None if callable(obj) else "a function or callable object"


def _class(obj: Any) -> str | None:
    return None if inspect.isclass(obj) else "a class"


def _engine(obj: Any) -> str | None:
    from rlhf.core.plugin_host.contracts import describe_missing
    from rlhf.core.protocols.rollout import RolloutEngine

    return _class(obj) or describe_missing(obj, RolloutEngine)


def _backend(obj: Any) -> str | None:
    from rlhf.core.protocols.backend import TrainBackend, sharded_but_not_saved
    from rlhf.core.plugin_host.contracts import describe_missing

    return _class(obj) or describe_missing(obj, TrainBackend) or sharded_but_not_saved(obj)


def _adapter(obj: Any) -> str | None:
    from rlhf.core.protocols.adapter import ModelAdapter
    from rlhf.core.plugin_host.contracts import describe_missing

    return _class(obj) or describe_missing(obj, ModelAdapter)


def _objective(obj: Any) -> str | None:
    from rlhf.core.plugin_host.contracts import describe_missing
    from rlhf.core.protocols.objective import Objective

    return _class(obj) or describe_missing(obj, Objective)


def _preset(obj: Any) -> str | None:
    from rlhf.core.types import AlgorithmPreset

    return None if isinstance(obj, AlgorithmPreset) else "an rlhf.core.types.AlgorithmPreset"


@dataclass(frozen=True)
class Kind:
    name: str  # singular, used in messages and `--json`: "advantage_estimator"
    hook: str  # registration hook that fills it
    flag: str  # the command-line option that selects one
    capabilities: dict[str, Any] = field(default_factory=dict)  # allowed flags and defaults
    check: Callable[[Any], str | None] = _callable  # returns what obj should have been
    promises: dict[str, str] = field(default_factory=dict)  # flag -> "module:Protocol" the class implements when true
    setting_capabilities: tuple[str, ...] = ()  # flags whose value is the name of one of the component's settings

    @property
    def title(self) -> str:
        return self.name.replace("_", " ")

    def problem(self, obj: Any, capabilities: dict[str, Any]) -> str | None:
        """What ``obj``, registered with ``capabilities``, should have been; None when it is fine:
        the kind's check, then the protocol of each promise its capabilities make."""
        return self.check(obj) or self.broken_promise(obj, capabilities)

    def broken_promise(self, obj: Any, capabilities: dict[str, Any]) -> str | None:
        """What ``obj`` lacks of the protocol a true capability in ``promises`` stands for, or None."""
        for flag, protocol in self.promises.items():
            if capabilities.get(flag):
                from rlhf.core.plugin_host.contracts import describe_missing
                from rlhf.core.plugin_host.references import import_object

                problem = describe_missing(obj, import_object(protocol))
                if problem:
                    return f"{problem}, as it declares {flag}=True"
        return None


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("advantage_estimator", "register_advantage_estimators", "--advantage",
             {"needs_critic": False, "needs_groups": False, "supports_masking": False, "implements": None}),
        Kind("policy_loss", "register_policy_losses", "--policy-loss",
             {"needs_rollout_logprobs": False, "aggregation": None, "advantage_weighted": False, "implements": None}),
        Kind("kl_estimator", "register_kl_estimators", "--kl-estimator", {"implements": None}),
        Kind("loss_aggregation", "register_loss_aggregations", "--loss-agg", {"sums_rows": False, "implements": None}),
        Kind("algorithm", "register_algorithms", "--algo", check=_preset),
        Kind("reward", "register_rewards", "--reward", {"batched": None, "is_async": None}),
        Kind("env", "register_envs", "--env", {"multi_turn": True, "gives_rewards": True, "needs_labels": False},
             check=_class),
        Kind("model", "register_models", "--model-adapter",
             {"roles": ("policy", "reference", "critic", "reward"), "merge_setting": None}, check=_adapter,
             setting_capabilities=("merge_setting",)),
        Kind("rollout_engine", "register_rollout_engines", "--engine",
             {"needs_gpu": False, "continuous_batching": False}, check=_engine, promises={"continuous_batching": "rlhf.core.protocols.rollout:ContinuousEngine"}),
        Kind("train_backend", "register_train_backends", "--backend",
             {"needs_gpu": False, "offloads_state": False, "sharding_setting": None, "shards_weights": False},
             check=_backend,
             setting_capabilities=("sharding_setting",)),
        Kind("sample_filter", "register_sample_filters", "--sample-filter"),
        Kind("reward_shaping", "register_reward_shapings", "--reward-shaping", {"enabled_by": None},
             setting_capabilities=("enabled_by",)),
        Kind("agent", "register_agents", "--agent"),
        Kind("tool_parser", "register_tool_parsers", "--tool-parser"),
        Kind("objective", "register_objectives", "--objective",
             {"needs_reference": False, "needs_teacher": False, "head": "lm", "default_lr": 1e-5, "command": False,
              "example": None, "preference_strength": None},
             check=_objective, setting_capabilities=("preference_strength",)),
    )
}

KIND_BY_HOOK: dict[str, Kind] = {kind.hook: kind for kind in KINDS.values()}


def get_kind(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise KeyError(f"unknown component kind {name!r}; kinds: {', '.join(KINDS)}") from None
