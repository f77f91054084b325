"""What the plans of both loops share: a run's components chosen and their configs built, resolved
once and checked before any model loads.

A `Plan` holds the run's options (``config``) and, for every slot of its loop (the config class's
``SLOTS``: the model adapter, the backend, then the loop's own: the RL algorithm's pieces, the
engine and the environment, or the fit loop's objective), the chosen component (`SlotChoice`):
a registered name, or a ``module:attr`` reference that needs no plugin (`choose`). A component's
config object is built from the user's settings for its slot and the run values its config class
asks for by name (``rlhf.core.plugin_host.settings``). ``rlhf.runtime.run.lifecycle.start_run``
then makes the plan's ``check`` on the number of ranks and prints its ``warnings``.

The RL loop's plan is `rlhf.runtime.config.train_plan.RunPlan`, the fit loop's
`rlhf.runtime.config.fit_plan.FitPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.references import is_reference, resolve
from rlhf.core.plugin_host.registry import declared_registration
from rlhf.core.plugin_host.settings import build_component_config, setting_fields
from rlhf.runtime.run.threads import requested_threads

if TYPE_CHECKING:
    from rlhf.core.plugin_host.loading import PluginSet
    from rlhf.runtime.config.options import Slot


@dataclass(frozen=True)
class SlotChoice:
    """The component chosen for one slot: its name, how to get the object, its config class."""

    name: str
    config_cls: type | None
    capabilities: dict[str, Any] = field(default_factory=dict)
    component: Any = None  # the registry's Component (None for a module:attr reference)
    obj: Any = None  # the object itself, when already loaded

    def load(self) -> Any:
        return self.obj if self.obj is not None else self.component.load()


def choose(name: str, kind: str, plugins: PluginSet) -> SlotChoice:
    """The component ``name`` names for a slot of ``kind``: a registered one, or a ``module:attr`` /
    ``file.py:attr`` reference (no plugin needed) checked as registration would check it, with the
    config class and capabilities it declares itself."""
    registry = plugins.registry(kind)
    if is_reference(name):
        obj = resolve(name).obj
        problem = registry.kind.check(obj)
        if problem:
            raise ConfigError(f"{name} is not a usable {kind.replace('_', ' ')}: {problem}")
        config_cls, capabilities = declared_registration(registry.kind, obj, name)
        return SlotChoice(name, config_cls, capabilities, obj=obj)
    component = registry.component(name)
    return SlotChoice(component.name, component.load_config_cls(), dict(component.capabilities), component=component)


def shared_run_values(config: Any) -> dict[str, Any]:
    """The run values every loop offers components (``rlhf.core.plugin_host.settings.RUN_VALUES``);
    each plan adds its loop's own."""
    return {"seed": config.seed, "model": config.model, "tokenizer": config.tokenizer or config.model,
            "dtype": config.dtype, "device": config.device, "trust_remote_code": config.trust_remote_code,
            "micro_batch_size": config.micro_batch_size, "synced_generation": False}


class Plan:
    """The base of both loops' plans (frozen dataclasses with ``config`` and ``choices``)."""

    config: Any
    choices: dict[str, SlotChoice]  # slot -> chosen component
    SLOTS: ClassVar[dict[str, Slot]]  # the loop's slots

    def run_values(self, **changes: Any) -> dict[str, Any]:
        """The values this run offers to components' run fields."""
        raise NotImplementedError

    def slot_settings(self, slot: str) -> dict[str, Any]:
        """The user's settings for the component in ``slot``."""
        return self.config.components.get(slot, {})

    def component_config(self, slot: str, *, settings: dict[str, Any] | None = None, **run_values: Any) -> Any:
        """The config object of the component in ``slot`` (None when it has no config class)."""
        choice, slot_info = self.choices[slot], self.SLOTS[slot]
        return build_component_config(choice.config_cls,
                                      settings=self.slot_settings(slot) if settings is None else settings,
                                      run_values=self.run_values(**run_values),
                                      who=f"the {choice.name!r} {slot_info.kind.replace('_', ' ')}",
                                      flag=slot_info.flag,
                                      short_flags=choice.component.short_flags if choice.component else ())

    def resolved_settings(self) -> dict[str, dict[str, Any]]:
        """Every setting of every chosen component as the run uses it (for config.yaml)."""
        out = {}
        for slot in self.SLOTS:
            config = self.component_config(slot)
            out[slot] = {} if config is None else {f.name: plain(getattr(config, f.name))
                                                   for f in setting_fields(type(config))}
        return out

    def run_config(self) -> dict[str, Any]:
        """The run's config as config.yaml records it (options, and every component setting)."""
        return {**self.config.to_dict(), "components": self.resolved_settings()}

    @property
    def out_dir(self) -> Path:
        return self.config.out_dir

    def check(self, *, world_size: int) -> None:
        """The checks that need the number of data-parallel ranks (``world_size``), made by
        ``start_run`` before anything is built."""
        self.check_ranks(world_size)
        requested_threads(self.config.threads)  # a count of at least 1, or auto

    def check_ranks(self, world_size: int) -> None:
        """The loop's own checks on ``world_size`` ranks."""

    def warnings(self) -> list[str]:
        """Options that will do nothing, one sentence each (printed before a run)."""
        return []


def plain(value: Any) -> Any:
    """A setting as config.yaml writes it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value
