"""Resolving the components the algorithm functions take: a registered name, a ``module:attr`` or
``file.py:attr`` reference, a `LoadedComponent`, or the object itself.

Names resolve through the registries of a `PluginSet`: the one passed as ``plugins=``, or one
built with ``build_plugin_manager()`` on first use (never at import) and kept for the process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from rlhf.core.errors import ConfigError, PluginError
from rlhf.core.plugin_host.kinds import get_kind
from rlhf.core.plugin_host.references import import_object, is_reference
from rlhf.core.plugin_host.registry import declared_registration

if TYPE_CHECKING:
    import torch

    from rlhf.core.plugin_host.loading import PluginSet


class AlgorithmConfigError(ConfigError):
    """An algorithm setting that cannot work (wrong value, or a combination that contradicts itself)."""


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

def plugin_set(plugins: PluginSet | None) -> PluginSet:
    """``plugins``, or the process-wide set of installed plugins built on first use."""
    from rlhf.core.plugin_host.loading import installed_plugins

    return installed_plugins(plugins)


def load_component(kind: str, ref: ComponentRef, *, plugins: PluginSet | None = None) -> LoadedComponent:
    """Resolve a name, a ``module:attr`` / ``file.py:attr`` reference or an object to a `LoadedComponent`.

    Raises `UnknownComponentError` (with close names) for an unknown name. An object or reference
    that is not registered declares its flags and config class as attributes (``needs_critic``,
    ``needs_groups``, ``config_cls``), or gets the kind's defaults.
    """
    if isinstance(ref, LoadedComponent):  # resolved once per run (`resolve_algorithm`): no look-up on the step path
        if ref.kind != kind:
            raise AlgorithmConfigError(f"{ref.name!r} is a {ref.kind.replace('_', ' ')}, "
                                       f"not a {get_kind(kind).title}")
        return ref
    spec = get_kind(kind)
    if isinstance(ref, str) and not is_reference(ref):
        component = plugin_set(plugins).registry(kind).component(ref)
        return LoadedComponent(kind, component.name, component.load(), component.load_config_cls(),
                               dict(component.capabilities))
    obj = import_object(ref) if isinstance(ref, str) else ref
    problem = spec.check(obj)
    if problem:
        raise PluginError(f"{spec.title} {ref!r} should be {problem}, got {type(obj).__name__}")
    name = ref if isinstance(ref, str) else getattr(obj, "__name__", type(obj).__name__)
    config_cls, capabilities = declared_registration(spec, obj, name)
    return LoadedComponent(kind, name, obj, config_cls, capabilities)


def build_config(component: LoadedComponent, base: type | None, settings: dict[str, Any],
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


def config_from_settings(component: LoadedComponent, settings: Mapping[str, Any], config: Any) -> Any:
    """The config object for one call: ``config`` as given, or the component's own config class built
    from ``settings`` (its defaults for the rest; None when it has no config class). A setting the
    class lacks is an error, and so are ``config`` and settings together."""
    if config is not None:
        if settings:
            raise AlgorithmConfigError(f"pass either config= or {', '.join(settings)}, not both")
        return config
    fields = {f.name for f in dataclasses.fields(component.config_cls)} if component.config_cls is not None else set()
    unsupported = [k for k in settings if k not in fields]
    if unsupported:
        raise AlgorithmConfigError(
            f"{component.kind.replace('_', ' ')} {component.name!r} has no setting "
            f"{', '.join(unsupported)}; its settings: {', '.join(sorted(fields)) or 'none'}"
        )
    return None if component.config_cls is None else component.config_cls(**settings)


def check_shape(name: str, tensor: Any, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def float_dtype(*tensors: Any) -> torch.dtype:
    """float64 when any input is float64, else float32 (half precision is too coarse for these sums)."""
    import torch

    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None and tensor.dtype == torch.float64:
            dtype = torch.float64
    return dtype
