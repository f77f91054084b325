"""`FitPlan`: what an offline run must agree on before any model loads, resolved and checked once.

* for each slot (`FIT_SLOTS`: model adapter, backend, objective) the chosen component, from the
  registries or a ``module:Class`` reference, with its config object built from the user's
  settings for that slot and the run values its config class asks for (``rlhf.core.plugin_host.settings``);
* the objective's registration flags (``needs_reference``, ``needs_teacher``, ``head``,
  ``default_lr``), resolved against its config object;
* the learning rate (``--lr``, else the objective's ``default_lr``) and the run's length in
  optimizer steps once the data is known (`with_examples`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.core.errors import ConfigError
from rlhf.core.protocols.objective import HEADS, resolve_flag
from rlhf.core.plugin_host.references import is_reference, resolve
from rlhf.core.plugin_host.registry import declared_registration
from rlhf.core.plugin_host.settings import build_component_config, setting_fields
from rlhf.runtime.config.fit_config import FIT_SLOTS, FitConfig
from rlhf.runtime.config.options import data_parallel_ranks
from rlhf.runtime.config.train_plan import SlotChoice
from rlhf.runtime.run.threads import requested_threads

if TYPE_CHECKING:
    from rlhf.core.plugin_host.loading import PluginSet


@dataclass(frozen=True)
class FitPlan:
    config: FitConfig
    choices: dict[str, SlotChoice]  # slot -> chosen component
    total_steps: int = 1  # optimizer steps of the whole run (LR schedules); see `with_examples`

    @classmethod
    def make(cls, config: FitConfig, plugins: PluginSet) -> FitPlan:
        """Resolve and check everything that needs no data and no model."""
        config.check()
        if not config.out:  # the run directory, named once
            config = dataclasses.replace(config, out=str(config.out_dir))
        plan = cls(config=config, choices={slot: _choice(getattr(config, slot), FIT_SLOTS[slot].kind, plugins)
                                           for slot in FIT_SLOTS})
        for slot in FIT_SLOTS:  # a bad or unknown setting stops the run before any model loads
            plan.component_config(slot)
        head = plan.head
        if head not in HEADS:
            raise ConfigError(f"the {config.objective!r} objective declares head={head!r}; heads: {', '.join(HEADS)}")
        if plan.needs_teacher and not config.teacher:
            raise ConfigError(f"the {config.objective!r} objective distills a teacher: pass --teacher MODEL "
                              "(a local HF directory or a hub name)")
        if plan.needs_teacher:
            from rlhf.core.hub import check_model_option

            check_model_option(config.teacher, "--teacher")  # before any model loads
        from rlhf.runtime.step.router_aux import check_routes

        check_routes(config.aux_loss_coef, config.model, trust_remote_code=config.trust_remote_code)
        roles = plan.choices["model_adapter"].capabilities.get("roles", ())
        wanted = ["reward" if head == "score" else "policy"] + (["reference"] if plan.needs_reference else [])
        missing = [role for role in wanted if role not in roles]
        if missing:
            raise ConfigError(f"the {config.model_adapter!r} model adapter builds no {' or '.join(missing)} model, "
                              f"which the {config.objective!r} objective needs; use --model-adapter hf")
        return plan

    def with_examples(self, num_examples: int) -> FitPlan:
        """The plan once the training data is encoded: the run's length in optimizer steps."""
        config = self.config
        steps = config.steps if config.steps is not None else config.epochs * max(1, num_examples // config.batch_size)
        return dataclasses.replace(self, total_steps=steps)

    # --- the objective ------------------------------------------------------------------------

    @property
    def objective_config(self) -> Any:
        # built before the learning rate is known (a callable default_lr reads this config)
        default_lr = self.choices["objective"].capabilities["default_lr"]
        lr = self.config.lr if self.config.lr is not None else (0.0 if callable(default_lr) else float(default_lr))
        return self.component_config("objective", lr=lr)

    def _flag(self, name: str) -> Any:
        return resolve_flag(self.choices["objective"].capabilities[name], self.objective_config)

    @property
    def needs_reference(self) -> bool:
        return bool(self._flag("needs_reference"))

    @property
    def needs_teacher(self) -> bool:
        return bool(self._flag("needs_teacher"))

    @property
    def head(self) -> str:
        return self._flag("head")

    @property
    def lr(self) -> float:
        return self.config.lr if self.config.lr is not None else float(self._flag("default_lr"))

    # --- component configs --------------------------------------------------------------------

    def run_values(self, **changes: Any) -> dict[str, Any]:
        """The values this run offers to components' run fields (``rlhf.core.plugin_host.settings.RUN_VALUES``)."""
        config = self.config
        values = {
            "seed": config.seed, "model": config.model, "tokenizer": config.tokenizer or config.model,
            "dtype": config.dtype, "device": config.device, "trust_remote_code": config.trust_remote_code,
            "max_prompt_length": config.max_len, "max_new_tokens": config.max_len, "max_turns": 1,
            "max_total_tokens": config.max_len, "temperature": 1.0, "total_steps": self.total_steps,
            "micro_batch_size": config.micro_batch_size, "synced_generation": False, "save_critic": False,
        }
        if "lr" not in changes:
            values["lr"] = self.lr
        return {**values, **changes}

    def component_config(self, slot: str, **run_values: Any) -> Any:
        """The config object of the component in ``slot`` (None when it has no config class)."""
        choice = self.choices[slot]
        slot_info = FIT_SLOTS[slot]
        if slot == "objective" and "lr" not in run_values:
            return self.objective_config
        return build_component_config(choice.config_cls, settings=self.config.components.get(slot, {}),
                                      run_values=self.run_values(**run_values),
                                      who=f"the {choice.name!r} {slot_info.kind.replace('_', ' ')}",
                                      flag=slot_info.flag)

    # --- before the run starts (``rlhf.runtime.run.lifecycle.start_run``) --------------------------

    @property
    def out_dir(self) -> Path:
        return self.config.out_dir

    def check(self, *, world_size: int) -> None:
        """What needs the number of data-parallel ranks (``world_size``) to check."""
        config = self.config
        if config.batch_size % world_size:
            raise ConfigError(f"--batch-size ({config.batch_size}) must be a multiple of "
                              f"{data_parallel_ranks(config, world_size)}")
        requested_threads(config.threads)  # a count of at least 1, or auto

    def warnings(self) -> list[str]:
        """Options that will do nothing (none known for offline runs)."""
        return []

    def run_config(self) -> dict[str, Any]:
        """The run's config as config.yaml records it (options, the LR used, every component setting)."""
        return {**self.config.to_dict(), "lr": self.lr, "components": self.resolved_settings()}

    def resolved_settings(self) -> dict[str, dict[str, Any]]:
        """Every setting of every chosen component as the run uses it (for config.yaml)."""
        out = {}
        for slot in FIT_SLOTS:
            config = self.component_config(slot)
            out[slot] = {} if config is None else {f.name: _plain(getattr(config, f.name))
                                                   for f in setting_fields(type(config))}
        return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _choice(name: str, kind: str, plugins: PluginSet) -> SlotChoice:
    registry = plugins.registry(kind)
    if is_reference(name):  # --objective my_pkg.module:MyObjective needs no plugin
        obj = resolve(name).obj
        problem = registry.kind.check(obj)
        if problem:
            raise ConfigError(f"{name} is not a usable {kind.replace('_', ' ')}: {problem}")
        config_cls, capabilities = declared_registration(registry.kind, obj, name)
        return SlotChoice(name, config_cls, capabilities, obj=obj)
    component = registry.component(name)
    return SlotChoice(component.name, component.load_config_cls(), dict(component.capabilities), component=component)
