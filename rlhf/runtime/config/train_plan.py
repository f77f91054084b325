"""`RunPlan`: everything the role builders of a run must agree on, resolved once and validated
before any model loads, the same for the local and the Ray runtime.

* the algorithm (``rlhf.algorithms.resolve_algorithm``);
* for every slot (`rlhf.runtime.config.train_config.SLOTS`) the chosen component and its config object, built
  from the user's settings for that slot (``--backend.zero-stage``, aliases, ``--algo-config``,
  ``--engine-config``, ``--env-config``) and the run values its config class asks for
  (``rlhf.core.plugin_host.settings``): nothing reaches a component by a matching field name;
* the checks both runtimes share (`RunPlan.check`) and its warnings (`RunPlan.warnings`), which
  ``rlhf.runtime.run.lifecycle.start_run`` makes before anything is built.

What it shares with the fit loop's plan (slot choices, component configs, config.yaml's record) is
`rlhf.runtime.config.plan.Plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rlhf.core.errors import ConfigError
from rlhf.core.plugin_host.references import is_reference, resolve
from rlhf.core.plugin_host.registry import declared_registration
from rlhf.core.plugin_host.settings import build_component_config, did_you_mean, resolve_flag, setting_fields
from rlhf.core.types import AdvantageConfig
from rlhf.runtime.config.options import Slot, data_parallel_ranks
from rlhf.runtime.config.plan import Plan, SlotChoice, choose, plain, shared_run_values
from rlhf.runtime.config.train_config import (ALGO_CONFIG_SLOTS, DEFAULT_SAMPLE_FILTER, SETTING_SLOTS, SLOTS, Derived,
                                              TrainConfig, colocation, parse_key_values, ray_env_pairs)

if TYPE_CHECKING:
    from rlhf.algorithms import ResolvedAlgorithm
    from rlhf.core.plugin_host.loading import PluginSet

_KEY_VALUE_FLAGS = {"engine": ("engine_config", "--engine-config"), "env": ("env_config", "--env-config")}


@dataclass(frozen=True)
class RunPlan(Plan):
    SLOTS: ClassVar[dict[str, Slot]] = SLOTS

    config: TrainConfig
    derived: Derived
    algorithm: ResolvedAlgorithm
    choices: dict[str, SlotChoice]  # slot -> chosen component
    settings: dict[str, dict[str, Any]]  # slot -> the user's settings for its component
    optimizer_steps: int = 1  # over the whole run (LR schedules); see `with_prompts`

    @classmethod
    def make(cls, config: TrainConfig, plugins: PluginSet) -> RunPlan:
        """Resolve and check everything that needs no data and no model."""
        from rlhf.algorithms import resolve_algorithm

        derived = config.derived()
        algorithm = resolve_algorithm(config.algo, advantage=config.advantage, policy_loss=config.policy_loss,
                                      kl_estimator=config.kl_estimator, kl_coef=config.kl_coef, kl_in=config.kl_in,
                                      loss_agg=config.loss_agg, n_samples=config.n_samples, plugins=plugins)
        choices = _choices(config, algorithm, plugins)
        plan = cls(config=config, derived=derived, algorithm=algorithm, choices=choices,
                   settings=_settings(config, choices))
        for slot in SLOTS:  # a bad or unknown setting stops the run before any model loads
            plan.component_config(slot)
        plan.check_env_settings(plugins)
        plan.reward_shapings(plugins)
        plan.check_masking()
        plan.check_model_refs(plugins)
        from rlhf.runtime.step.router_aux import check_routes

        check_routes(config.aux_loss_coef, config.model, trust_remote_code=config.trust_remote_code)
        return plan

    def check_masking(self) -> None:
        """``--on-failure mask`` (and ``--reward-on-error skip``, which means it) leaves failed samples in
        their groups, masked: only an estimator registered with ``supports_masking`` takes its
        baselines over the others (docs/outcomes.md)."""
        config, estimator = self.config, self.algorithm.advantage
        how = ("--reward-on-error skip" if config.reward_options.on_error == "skip"
               else "--on-failure mask" if config.on_failure == "mask" else None)
        if how is not None and not estimator.capabilities.get("supports_masking"):
            raise ConfigError(f"{how} keeps failed samples in their groups, masked, and the advantage estimator "
                              f"{estimator.name!r} does not declare supports_masking (its baselines would count "
                              "them); use --on-failure retry or drop-group, or an estimator that supports masking")

    def check_model_refs(self, plugins: PluginSet) -> None:
        """``--critic-model`` (when the algorithm trains a critic) and each ``--reward`` taken as a hub
        reward model name a local model directory or a hub model that can be had (`rlhf.core.hub`):
        one usage error naming the flag otherwise, before any model loads."""
        from rlhf.core.hub import check_model_option
        from rlhf.rewards.loading import check_hub_reward_models

        if self.config.critic_model and self.algorithm.needs_critic:
            check_model_option(self.config.critic_model, "--critic-model")
        if self.algorithm.needs_teacher and not self.config.teacher:
            raise ConfigError(f"--algo {self.algorithm.algo} distils a teacher: pass --teacher MODEL (a local HF "
                              "directory or a hub name with the policy's tokenizer)")
        if self.config.teacher:
            check_model_option(self.config.teacher, "--teacher")
        check_hub_reward_models(self.config.reward, plugins.registry("reward"))

    def with_prompts(self, num_prompts: int) -> RunPlan:
        """The plan once the data is known: the run's length in optimizer steps."""
        return dataclasses.replace(self, optimizer_steps=self.total_steps(num_prompts) *
                                   self.derived.optimizer_steps_per_step)

    def total_steps(self, num_prompts: int) -> int:
        config = self.config
        return config.steps if config.steps is not None else max(1, num_prompts // config.prompts_per_step)

    # --- component configs --------------------------------------------------------------------

    def run_values(self, **changes: Any) -> dict[str, Any]:
        """The values this run offers to components' run fields (``rlhf.core.plugin_host.settings.RUN_VALUES``)."""
        config = self.config
        values = {
            **shared_run_values(config), "max_prompt_length": config.max_prompt_length,
            "max_new_tokens": config.max_new_tokens, "max_turns": config.max_turns,
            "max_total_tokens": self.token_budget, "temperature": config.temperature, "lr": config.lr,
            "total_steps": self.optimizer_steps, "save_critic": config.save_critic,
            "verify_weight_sync": config.verify_weight_sync, "weight_sync_timeout_s": config.weight_sync_timeout_s,
        }
        unknown = set(changes) - set(values)
        assert not unknown, f"not run values: {sorted(unknown)}"
        return {**values, **changes}

    def slot_settings(self, slot: str) -> dict[str, Any]:
        return self.settings.get(slot, {})  # the namespaced settings and the KEY=VALUE flags routed here

    def component_config(self, slot: str, *, settings: dict[str, Any] | None = None, **run_values: Any) -> Any:
        if slot == "env" and self.choices[slot].config_cls is None:
            return None  # --env.* settings are then for environments picked per sample (`env_settings`)
        return super().component_config(slot, settings=settings, **run_values)

    @property
    def policy_loss_config(self) -> Any:
        return self.component_config("policy_loss")

    @property
    def advantage_config(self) -> Any:
        return self.component_config("advantage")

    @property
    def token_budget(self) -> int:
        """Tokens per trajectory: prompt + every turn + observations."""
        config = self.config
        return config.max_total_tokens or config.max_prompt_length + config.max_turns * config.max_new_tokens

    def resolved_settings(self) -> dict[str, dict[str, Any]]:
        out = super().resolved_settings()
        if self.component_config("env") is None:  # no config class: the settings are for per-sample environments
            out["env"] = dict(self.settings.get("env", {}))
        out["reward_shaping"] = {k: plain(v) for k, v in self.settings.get("reward_shaping", {}).items()}
        return out

    def check_env_settings(self, plugins: PluginSet) -> None:
        """When the run's environment has no config class, its ``--env.*`` settings are for environments
        the data picks per sample: each must be an option of a registered environment (else it would
        be dropped without a word)."""
        if self.choices["env"].config_cls is not None:
            return
        given = self.settings.get("env", {})
        known = _registered_settings(plugins.registry("env"))
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"no environment has an option {unknown[0]} (--env.{unknown[0].replace('_', '-')}); the "
                              f"{self.config.env!r} environment has no options, and those of the environments a label "
                              f"may pick are: {', '.join(sorted(known)) or 'none'}{did_you_mean(unknown[0], known)}")

    def env_settings(self, name: str, config_cls: type | None) -> dict[str, Any]:
        """The ``--env.*`` settings for environment ``name``: all of them for the run's ``--env``; for
        an environment a label picks (``env_func``), those its config class declares."""
        given = self.settings.get("env", {})
        if config_cls is None:
            return {}
        if name == self.config.env:
            return dict(given)
        declared = {f.name for f in setting_fields(config_cls)}
        return {k: v for k, v in given.items() if k in declared}

    # --- before the run starts (``rlhf.runtime.run.lifecycle.start_run``) --------------------------

    @property
    def out_dir(self) -> Path:
        return self.derived.out_dir

    def check_ranks(self, world_size: int) -> None:
        """The checks both runtimes make before starting anything (``world_size``: data-parallel ranks)."""
        config, derived = self.config, self.derived
        if config.agent:
            self._check_agent(world_size)
        elif not config.reward and not config.teacher and not self.env_capability("gives_rewards"):
            raise ConfigError(f"--reward is required (a reward function, URL or reward model) or a --teacher: the "
                              f"{config.env!r} environment gives no rewards; see `rlhf train --help`")
        if not config.label_key and self.env_capability("needs_labels"):
            raise ConfigError(f"the {config.env!r} environment checks answers against labels and the data gives "
                              "none: pass --label-key COLUMN, the data's answer column")
        for name, size in (("--prompts-per-step", config.prompts_per_step),
                           ("--train-batch-size", derived.train_batch_size)):
            if size % world_size:
                raise ConfigError(f"{name} ({size}) must be a multiple of {data_parallel_ranks(config, world_size)}")
        if config.async_rollout and config.runtime == "local" and world_size > 1:
            raise ConfigError("--async in the local runtime runs generation beside training in one process: it "
                              "does not support several processes (torchrun) yet; use --runtime ray for data "
                              "parallelism")
        if config.async_rollout and config.runtime == "ray" and colocation(config.colocate) == ("all",):
            raise ConfigError("--async needs rollout actors with their own copy of the policy, and --colocate all "
                              "puts the rollout in the policy actors: use --colocate none or policy_ref")
        if config.offload_train_state:
            self._check_offload_train_state()
        if config.async_rollout and config.runtime == "local" and self.shards_weights:
            raise ConfigError(f"--async copies the policy's weights for generation, and the {config.backend!r} backend "
                              f"shards them: {self.whole_weights_advice()}, or drop --async")
        if self.synced_generation(world_size) and self.env_capability("multi_turn"):
            raise ConfigError(f"--env {config.env} on several ranks with a backend that shards the weights is not "
                              f"supported yet: every rank must make the same generate calls; "
                              f"{self.whole_weights_advice()}, or run one process")
        if config.runtime == "ray":
            self._check_ray()

    def _check_agent(self, world_size: int) -> None:
        """What ``--agent`` refuses, before anything is built: an environment (by design: the agent is
        the environment), ranks that decode in lockstep, and partial rollouts."""
        config = self.config
        if config.env != "single_turn":
            raise ConfigError(f"--agent replaces the environment: its tools and its turns are the agent's own code, "
                              f"so a run takes --agent or --env, not both; drop --env {config.env}")
        if self.synced_generation(world_size):
            raise ConfigError(f"--agent with the {config.backend!r} backend sharding the weights over several ranks is "
                              f"not supported: those ranks decode in lockstep, and each agent sends its requests when "
                              f"it likes; {self.whole_weights_advice()}, or run one process")
        if config.partial_rollouts:
            raise ConfigError("--agent with --partial-rollouts is not supported yet: an agent's requests are served "
                              "by one policy version per trajectory (--async --max-staleness K works); drop "
                              "--partial-rollouts")

    def _check_ray(self) -> None:
        config = self.config
        for flag, actors in (("--policy-actors", config.policy_actors), ("--critic-actors", config.critic_actors or 1)):
            if self.derived.train_batch_size % actors:
                raise ConfigError(f"--train-batch-size ({self.derived.train_batch_size}) must be a multiple of {flag} "
                                  f"({actors}): every data-parallel rank trains the same number of rows")
        ray_env_pairs(config)  # KEY=VALUE syntax
        if config.weight_sync == "broadcast" and config.async_rollout:
            raise ConfigError("--async loads the weights of a given policy version, which only the object store "
                              "keeps: use --weight-sync object-store with --async")

    @property
    def shards_weights(self) -> bool:
        """Whether the policy's backend will partition its weights over the ranks, as its registration
        declares (``shards_weights``: a bool or a function of its config); the built backend must agree."""
        return bool(resolve_flag(self.choices["backend"].capabilities["shards_weights"],
                                 self.component_config("backend")))

    def synced_generation(self, world_size: int) -> bool:
        """Whether ranks decode in lockstep: the engine samples from the trained policy itself, whose
        forwards are collectives over several ranks (sharded weights)."""
        if not self.shards_weights:
            return False
        if self.config.runtime == "ray":  # the rollout in the policy actors samples from their shards
            return colocation(self.config.colocate) == ("all",) and self.config.policy_actors > 1
        return world_size > 1

    def _check_offload_train_state(self) -> None:
        config = self.config
        if config.runtime == "ray" and colocation(config.colocate) != ("all",):
            raise ConfigError("--offload-train-state frees the training state's device memory for the engine in the "
                              "same process: under --runtime ray that needs --colocate all (the rollout in the "
                              "policy actors)")
        if config.async_rollout:
            raise ConfigError("--offload-train-state moves the training state away while the engine generates, and "
                              "--async generates while training: use one or the other")
        backend = self.choices["backend"]
        if not backend.capabilities.get("offloads_state", False):
            raise ConfigError(f"the {backend.name!r} train backend cannot move its training state off the device (it "
                              "registers no offloads_state=True): drop --offload-train-state, or use a backend that "
                              "can (`rlhf plugins list`)")

    def whole_weights_advice(self) -> str:
        """How to keep the policy's weights whole on every rank, for messages: lower the setting the
        backend declares shards its memory (``sharding_setting``, by the flag a user types), or
        choose a backend that does not shard."""
        backend = self.choices["backend"]
        setting = backend.capabilities.get("sharding_setting")
        if setting is None:
            return f"use a backend that keeps whole weights on every rank (not {backend.name!r})"
        dashed = setting.replace("_", "-")
        short = (backend.component is not None and setting in backend.component.short_flags
                 and setting not in {f.name for f in dataclasses.fields(TrainConfig)})
        flag = f"--{dashed}" if short else f"{SLOTS['backend'].flag}.{dashed}"
        return (f"lower {flag} (the {backend.name!r} backend's sharding setting) until it keeps whole weights on "
                "every rank")

    def warnings(self) -> list[str]:
        """Options that will do nothing, one sentence each (both runtimes print them before a run)."""
        found = []
        if self.config.save_critic and not self.algorithm.needs_critic:
            found.append(f"--save-critic: algorithm {self.config.algo!r} trains no critic; none is saved")
        if self.config.weight_sync != "object-store" and self.config.runtime != "ray":
            found.append(f"--weight-sync {self.config.weight_sync}: the local runtime's engine reads the policy in "
                         "this process; weights travel only between Ray actors (--runtime ray)")
        return found

    # --- what the run builds ------------------------------------------------------------------

    @property
    def filters_groups(self) -> bool:
        return bool(self.choices["sample_filter"].name)

    def sample_filter(self) -> tuple[Any, Any] | None:
        """``(filter, its config)`` when the run filters prompt groups, else None."""
        if not self.filters_groups:
            return None
        return self.choices["sample_filter"].load(), self.component_config("sample_filter")

    def reward_shapings(self, plugins: PluginSet) -> list[tuple[str, Any, Any]]:
        """``(name, shaping, config)`` in the order they apply: the registered shapings whose
        ``enabled_by`` setting is given (``--overlong-buffer 8``), by name, then
        ``--reward-shaping`` in the order given. Each receives the ``--reward-shaping.*`` settings its
        config class declares; a setting none of the registered shapings declares is an error."""
        given = self.settings.get("reward_shaping", {})
        registry = plugins.registry("reward_shaping")
        enabled = [component.name for component in registry.components()
                   if component.capabilities.get("enabled_by") and given.get(component.capabilities["enabled_by"])
                   is not None]
        declared: set[str] = set()
        out = []
        for name in dict.fromkeys(enabled + list(self.config.reward_shaping)):
            if is_reference(name):
                obj = resolve(name).obj
                config_cls, _ = declared_registration(registry.kind, obj, name)
            else:
                component = registry.component(name)
                obj, config_cls, name = component.load(), component.load_config_cls(), component.name
            own = {f.name for f in setting_fields(config_cls)}
            declared |= own
            shaping_config = build_component_config(config_cls, settings={k: v for k, v in given.items() if k in own},
                                                    run_values=self.run_values(), who=f"the {name!r} reward shaping",
                                                    flag="--reward-shaping")
            out.append((name, obj, shaping_config))
        unknown = sorted(set(given) - declared - _registered_settings(registry))
        if unknown:
            raise ConfigError(f"no reward shaping has an option {unknown[0]} (--reward-shaping."
                              f"{unknown[0].replace('_', '-')}); `rlhf plugins list` shows the reward shapings"
                              f"{did_you_mean(unknown[0], declared | _registered_settings(registry))}")
        return out

    def env_capability(self, flag: str) -> Any:
        return self.choices["env"].capabilities[flag]

    @property
    def rollout_logprobs(self) -> bool:
        """Ask the engine for the sampled tokens' log-probs (the policy loss reads them)."""
        return self.algorithm.needs_rollout_logprobs(self.policy_loss_config)


def _registered_settings(registry: Any) -> set[str]:
    names: set[str] = set()
    for component in registry.components():
        try:
            names |= {f.name for f in setting_fields(component.load_config_cls())}
        except Exception:  # noqa: BLE001 - a broken plugin is reported by `rlhf plugins list`
            continue
    return names


def _choices(config: TrainConfig, algorithm: ResolvedAlgorithm, plugins: PluginSet) -> dict[str, SlotChoice]:
    choices = {}
    for slot, loaded in (("advantage", algorithm.advantage), ("policy_loss", algorithm.policy_loss),
                         ("kl_estimator", algorithm.kl_estimator), ("loss_agg", algorithm.loss_agg)):
        config_cls = loaded.config_cls or (AdvantageConfig if slot == "advantage" else None)
        choices[slot] = SlotChoice(loaded.name, config_cls, dict(loaded.capabilities), obj=loaded.obj)
    for slot in ("model_adapter", "engine", "backend", "env", "sample_filter", "agent", "tool_parser"):
        name = getattr(config, slot)
        if slot == "sample_filter":
            name = name or (DEFAULT_SAMPLE_FILTER if config.filter_groups else None)
        if name is None:  # no filtering, no agent: an empty choice, with no config class
            choices[slot] = SlotChoice("", None)
            continue
        choices[slot] = choose(name, SLOTS[slot].kind, plugins)
    if config.agent:
        choices["agent"] = _agent_choice(choices["agent"])
    return choices


def _agent_choice(choice: SlotChoice) -> SlotChoice:
    """Every agent's settings include `AgentConfig`'s (``--agent.timeout-s``): an agent without a config
    class gets it, one with its own must subclass it."""
    from rlhf.core.protocols.agent import AgentConfig

    if choice.config_cls is None:
        return dataclasses.replace(choice, config_cls=AgentConfig)
    if not (isinstance(choice.config_cls, type) and issubclass(choice.config_cls, AgentConfig)):
        raise ConfigError(f"agent {choice.name!r}: its config_cls {choice.config_cls.__name__} must subclass "
                          "rlhf.api.AgentConfig (which gives every agent --agent.timeout-s)")
    return choice


def _settings(config: TrainConfig, choices: dict[str, SlotChoice]) -> dict[str, dict[str, Any]]:
    """Each slot's settings: the namespaced ones, then KEY=VALUE flags routed to their slot."""
    settings = {slot: dict(values) for slot, values in config.components.items()}
    for slot, (field_name, flag) in _KEY_VALUE_FLAGS.items():
        for key, value in parse_key_values(getattr(config, field_name), flag).items():
            _put(settings, slot, key, value, f"{flag} {key}")
    for key, value in parse_key_values(config.algo_config, "--algo-config").items():
        owners = [slot for slot in ALGO_CONFIG_SLOTS
                  if key in {f.name for f in setting_fields(choices[slot].config_cls)}]
        if not owners:
            options = sorted({f.name for slot in ALGO_CONFIG_SLOTS for f in setting_fields(choices[slot].config_cls)})
            raise ConfigError(f"--algo-config {key}: none of the run's policy loss, advantage estimator, KL estimator, "
                              f"loss aggregation or model adapter has an option {key}; their options: "
                              f"{', '.join(options)}{did_you_mean(key, options)}")
        if len(owners) > 1:
            raise ConfigError(f"--algo-config {key}: several components have an option {key}; use "
                              + " or ".join(f"{SLOTS[s].flag}.{key.replace('_', '-')}" for s in owners))
        _put(settings, owners[0], key, value, f"--algo-config {key}")
    return settings


def _put(settings: dict[str, dict[str, Any]], slot: str, key: str, value: Any, how: str) -> None:
    current = settings.setdefault(slot, {})
    if key in current and current[key] != value:
        raise ConfigError(f"{how}: {SETTING_SLOTS[slot].flag}.{key.replace('_', '-')} is already {current[key]!r}")
    current[key] = value
