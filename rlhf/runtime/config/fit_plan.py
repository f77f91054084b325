"""`FitPlan`: what an offline run must agree on before any model loads, resolved and checked once.

* for each slot (`FIT_SLOTS`: model adapter, backend, objective) the chosen component, from the
  registries or a ``module:Class`` reference, with its config object built from the user's
  settings for that slot and the run values its config class asks for (``rlhf.core.plugin_host.settings``);
* the objective's registration flags (``needs_reference``, ``needs_teacher``, ``head``,
  ``default_lr``), resolved against its config object;
* the learning rate (``--lr``, else the objective's ``default_lr``) and the run's length in
  optimizer steps once the data is known (`with_examples`).

What it shares with the RL loop's plan is `rlhf.runtime.config.plan.Plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.settings import resolve_flag
from rlhf.core.protocols.objective import HEADS
from rlhf.runtime.config.fit_config import FIT_SLOTS, FitConfig
from rlhf.runtime.config.options import Slot, data_parallel_ranks
from rlhf.runtime.config.plan import Plan, SlotChoice, choose, shared_run_values

if TYPE_CHECKING:
    from rlhf.core.plugin_host.loading import PluginSet


@dataclass(frozen=True)
class FitPlan(Plan):
    SLOTS: ClassVar[dict[str, Slot]] = FIT_SLOTS

    config: FitConfig
    choices: dict[str, SlotChoice]  # slot -> chosen component
    total_steps: int = 1  # optimizer steps of the whole run (LR schedules); see `with_examples`

    @classmethod
    def make(cls, config: FitConfig, plugins: PluginSet) -> FitPlan:
        """Resolve and check everything that needs no data and no model."""
        config.check()
        if not config.out:  # the run directory, named once
            config = dataclasses.replace(config, out=str(config.out_dir))
        plan = cls(config=config, choices={slot: choose(getattr(config, slot), FIT_SLOTS[slot].kind, plugins)
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
            **shared_run_values(config), "max_prompt_length": config.max_len, "max_new_tokens": config.max_len,
            "max_turns": 1, "max_total_tokens": config.max_len, "temperature": 1.0, "total_steps": self.total_steps,
            "save_critic": False,
        }
        if "lr" not in changes:
            values["lr"] = self.lr
        return {**values, **changes}

    def component_config(self, slot: str, *, settings: dict[str, Any] | None = None, **run_values: Any) -> Any:
        if slot == "objective" and "lr" not in run_values and settings is None:
            return self.objective_config  # its learning rate first (a callable default_lr reads the config)
        return super().component_config(slot, settings=settings, **run_values)

    # --- before the run starts (``rlhf.runtime.run.lifecycle.start_run``) --------------------------

    def check_ranks(self, world_size: int) -> None:
        config = self.config
        if config.batch_size % world_size:
            raise ConfigError(f"--batch-size ({config.batch_size}) must be a multiple of "
                              f"{data_parallel_ranks(config, world_size)}")

    def run_config(self) -> dict[str, Any]:
        """The run's config as config.yaml records it (options, the LR used, every component setting)."""
        return {**super().run_config(), "lr": self.lr}
