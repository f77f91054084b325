"""The embedded local runtime: every worker in this process, on one device (CPU or one GPU).

`train(config)` is what ``rlhf train`` calls; tests and notebooks call it directly too. Started
by a launcher (``torchrun --nproc-per-node N -m rlhf train ...``), each process is one
data-parallel rank running the same loop (rlhf/core/distributed.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.core.errors import ConfigError
from rlhf.core.fingerprint import plugin_fingerprint
from rlhf.core.plugins import PluginSet, build_plugin_manager
from rlhf.runtime.config import Derived, TrainConfig, parse_key_values
from rlhf.runtime.data import DataSettings, PromptFormatter, PromptLoader, load_prompts
from rlhf.core.distributed import SINGLE, DistContext, init_from_environment
from rlhf.runtime.trainer import Trainer, Workers
from rlhf.runtime.rollout import EnvFactory, RolloutSettings, RolloutWorker
from rlhf.runtime.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker, UpdateSettings


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def component_config(config_cls: type | None, values: dict[str, Any], overrides: dict[str, Any] | None = None) -> Any:
    """An instance of a component's config class from the run's values with matching names."""
    if config_cls is None:
        return None
    names = {f.name for f in dataclasses.fields(config_cls)}
    chosen = {k: v for k, v in values.items() if k in names}
    chosen.update({k: v for k, v in (overrides or {}).items() if k in names})
    return config_cls(**chosen)


# --- one builder per role: the local runtime calls them all in this process; the Ray runtime calls
# --- each inside the actor that holds the role.


@dataclass(frozen=True)
class RunPlan:
    """What every role builder needs to agree on: settings and the resolved algorithm."""

    config: TrainConfig
    derived: Derived
    values: dict[str, Any]  # the config as a flat dict (component configs are filled from it)
    overrides: dict[str, Any]  # --algo-config KEY=VALUE
    algorithm: Any  # rlhf.algorithms.ResolvedAlgorithm
    optimizer_steps: int  # over the whole run (LR schedule length)

    @classmethod
    def make(cls, config: TrainConfig, derived: Derived, plugins: PluginSet, num_prompts: int) -> RunPlan:
        from rlhf.algorithms import resolve_algorithm

        algorithm = resolve_algorithm(config.algo, advantage=config.advantage, policy_loss=config.policy_loss,
                                      kl_estimator=config.kl_estimator, kl_coef=config.kl_coef, kl_in=config.kl_in,
                                      loss_agg=config.loss_agg, n_samples=config.n_samples, plugins=plugins)
        steps = total_steps(config, num_prompts)
        return cls(config=config, derived=derived, values=config.to_dict(),
                   overrides=parse_key_values(config.algo_config), algorithm=algorithm,
                   optimizer_steps=steps * derived.optimizer_steps_per_step)

    @property
    def update(self) -> UpdateSettings:
        return UpdateSettings(ppo_epochs=self.config.ppo_epochs, train_batch_size=self.derived.train_batch_size,
                              micro_batch_size=self.config.micro_batch_size,
                              max_new_tokens=self.config.max_new_tokens, seed=self.config.seed)

    @property
    def policy_loss_config(self) -> Any:
        return component_config(self.algorithm.policy_loss_config_cls, self.values, self.overrides)

    @property
    def advantage_config(self) -> Any:
        return component_config(self.algorithm.advantage_config_cls, self.values, self.overrides)


def total_steps(config: TrainConfig, num_prompts: int) -> int:
    return config.steps if config.steps is not None else max(1, num_prompts // config.prompts_per_step)


def build_adapter(plan: RunPlan, plugins: PluginSet) -> Any:
    models = plugins.registry("model").component(plan.config.model_adapter)
    return models.load()(component_config(models.load_config_cls(), plan.values, plan.overrides))


def build_backend(plan: RunPlan, plugins: PluginSet, model: torch.nn.Module, lr: float) -> Any:
    backends = plugins.registry("train_backend").component(plan.config.backend)
    values = {**plan.values, "lr": lr, "adam_betas": plan.derived.adam_betas, "total_steps": plan.optimizer_steps,
              "warmup_steps": math.ceil(plan.config.warmup_ratio * plan.optimizer_steps)}
    return backends.load()(model, component_config(backends.load_config_cls(), values))


def build_policy(plan: RunPlan, plugins: PluginSet, adapter: Any, dist: DistContext = SINGLE) -> PolicyWorker:
    config, algorithm = plan.config, plan.algorithm
    model = adapter.load(config.model, role="policy")
    objective = algorithm.policy_objective(plan.policy_loss_config, entropy_coef=config.entropy_coef,
                                           temperature=config.temperature)
    return PolicyWorker(model, build_backend(plan, plugins, model, config.lr), plan.update, objective, dist)


def build_reference(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE) -> ReferenceWorker:
    config = plan.config
    return ReferenceWorker(adapter.load(config.model, role="reference"), config.micro_batch_size,
                           config.temperature, dist)


def build_critic(plan: RunPlan, plugins: PluginSet, adapter: Any, dist: DistContext = SINGLE) -> CriticWorker:
    config = plan.config
    model = adapter.load(config.critic_model or config.model, role="critic")
    return CriticWorker(model, build_backend(plan, plugins, model, config.critic_lr), plan.update,
                        plan.algorithm.value_objective(config.value_clip), dist)


def build_rollout(plan: RunPlan, plugins: PluginSet, model: torch.nn.Module, tokenizer: Any, *,
                  synced_generation: bool = False) -> RolloutWorker:
    """``synced_generation``: ``model`` is a trained policy whose forwards are collectives over its
    ranks (the backend's ``needs_synced_generation``, e.g. DeepSpeed ZeRO-3), so ranks decode in lockstep."""
    config = plan.config
    if synced_generation and config.env != "single_turn":
        raise ConfigError(f"--env {config.env} with --zero-stage 3 on several ranks is not supported yet: every rank "
                          "must make the same generate calls; use --zero-stage 2, or one process")
    engines = plugins.registry("rollout_engine").component(config.engine)
    values = {**plan.values, "synced_gpus": synced_generation}
    config_cls = engines.load_config_cls()
    overrides = parse_key_values(config.engine_config, "--engine-config")
    known = [f.name for f in dataclasses.fields(config_cls)] if config_cls is not None else []
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        fields = ", ".join(known) or "none"
        raise ConfigError(f"--engine-config: the {config.engine!r} engine has no option {', '.join(unknown)}; "
                          f"its options: {fields}")
    engine = engines.load()(model, tokenizer, component_config(config_cls, values, overrides))
    env_values = {**plan.values, **parse_key_values(config.env_config, "--env-config")}
    budget = config.max_total_tokens or config.max_prompt_length + config.max_turns * config.max_new_tokens
    return RolloutWorker(engine, tokenizer, EnvFactory(plugins.registry("env"), env_values),
                         RolloutSettings(env=config.env, max_turns=config.max_turns, max_total_tokens=budget))


def build_reward(config: TrainConfig, plugins: PluginSet) -> RewardWorker | None:
    """The reward sources, or None when the environment gives every reward."""
    from rlhf.rewards import load_rewards

    if not config.reward:
        return None
    options = dataclasses.asdict(config.reward_options)
    return RewardWorker(load_rewards(config.reward, plugins=plugins, on_error=options.pop("on_error"), **options))


def build_loader(config: TrainConfig, tokenizer: Any) -> PromptLoader:
    settings = DataSettings(paths=config.data, input_key=config.input_key, label_key=config.label_key,
                            probs=[float(p) for p in config.data_probs.split(",")] if config.data_probs else None,
                            split=config.data_split, apply_chat_template=config.apply_chat_template,
                            input_template=config.input_template, max_prompt_length=config.max_prompt_length,
                            max_samples=config.max_samples, seed=config.seed)
    return PromptLoader(load_prompts(settings), PromptFormatter(tokenizer, settings), seed=config.seed)


def export_final(plan: RunPlan, adapter: Any, tokenizer: Any, policy: Any, critic: Any, out_dir: Path,
                 dist: DistContext = SINGLE) -> None:
    """The final policy to ``out_dir`` (and ``--save-critic`` to ``<out>/critic``), by the main rank.

    Called on every rank: a backend that shards the weights (``full_weights``, DeepSpeed ZeRO-3)
    gathers them with every rank taking part while the main rank writes.
    """
    with full_weights(policy):
        if dist.is_main:
            if hasattr(adapter, "save"):  # adapters may write their own layout (e.g. a LoRA adapter + merged model)
                adapter.save(policy.model, tokenizer, out_dir)
            else:
                policy.model.save_pretrained(out_dir)
                tokenizer.save_pretrained(out_dir)
    if critic is not None and plan.config.save_critic:
        with full_weights(critic):
            if dist.is_main:
                critic_dir = plan.derived.out_dir / "critic"
                if hasattr(adapter, "save_critic"):
                    adapter.save_critic(critic.model, tokenizer, critic_dir)
                else:
                    critic.model.save_pretrained(critic_dir)


def full_weights(worker: Any) -> Any:
    """A context in which ``worker.model`` holds its whole weights (its backend's, when it shards them)."""
    gather = getattr(worker.backend, "full_weights", None)
    return gather() if gather is not None else contextlib.nullcontext()


def build_workers(config: TrainConfig, derived: Derived, plugins: PluginSet, dist: DistContext = SINGLE) -> Workers:
    """Every worker in this process."""
    seed_everything(config.seed)
    reward = build_reward(config, plugins)
    probe = RunPlan.make(config, derived, plugins, num_prompts=0)  # resolves the algorithm before any model loads
    adapter = build_adapter(probe, plugins)
    tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
    loader = build_loader(config, tokenizer)
    plan = dataclasses.replace(probe, optimizer_steps=total_steps(config, len(loader)) * derived.optimizer_steps_per_step)

    policy = build_policy(plan, plugins, adapter, dist)
    reference = build_reference(plan, adapter, dist) if plan.algorithm.needs_reference else None
    critic = build_critic(plan, plugins, adapter, dist) if plan.algorithm.needs_critic else None
    if config.save_critic and critic is None:
        import logging

        logging.getLogger(__name__).warning("--save-critic: algorithm %r trains no critic; none is saved", config.algo)
    return Workers(
        policy=policy, reward=reward,
        rollout=build_rollout(plan, plugins, policy.model, tokenizer,
                              synced_generation=getattr(policy.backend, "needs_synced_generation", False)),
        reference=reference, critic=critic, tokenizer=tokenizer, loader=loader, algorithm=plan.algorithm,
        advantage_config=plan.advantage_config, pad_token_id=tokenizer.pad_token_id,
        fingerprint=plugin_fingerprint(plugins),
        export_policy=lambda out_dir: export_final(plan, adapter, tokenizer, policy, critic, out_dir, dist),
        rollout_logprobs=getattr(plan.policy_loss_config, "correction", None) is not None, dist=dist,
    )


def train(config: TrainConfig, *, plugins: PluginSet | None = None) -> Path:
    """Run training with the local runtime; returns the run directory."""
    plugins = plugins or build_plugin_manager()
    if plugins.broken:
        import logging

        logging.getLogger(__name__).warning(
            "some plugins failed to load (see `rlhf plugins list`): %s", ", ".join(r.label for r in plugins.broken))
    derived = config.derived()
    if config.threads is not None:
        if config.threads < 1:
            raise ConfigError(f"--threads must be at least 1; got {config.threads}")
        torch.set_num_threads(config.threads)
    dist = init_from_environment()
    for name, size in (("--prompts-per-step", config.prompts_per_step),
                       ("--train-batch-size", derived.train_batch_size)):
        if size % dist.world_size:
            raise ConfigError(f"{name} ({size}) must be a multiple of the number of processes ({dist.world_size})")
    if not config.reward and config.env == "single_turn":
        raise ConfigError("--reward is required (a reward function, URL or reward model) unless an --env gives "
                          "rewards; see `rlhf train --help`")
    try:
        workers = build_workers(config, derived, plugins, dist)
        return Trainer(config, derived, plugins, workers).run()
    finally:
        dist.close()
