"""The embedded local runtime: every worker in this process, on one device (CPU or one GPU).

`train(config)` is what ``rlhf train`` calls; tests and notebooks call it directly too. Started
by a launcher (``torchrun --nproc-per-node N -m rlhf train ...``), each process is one
data-parallel rank running the same loop (rlhf/runtime/distributed.py).
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import torch

from rlhf.core.errors import ConfigError
from rlhf.core.fingerprint import plugin_fingerprint
from rlhf.core.plugins import PluginSet, build_plugin_manager
from rlhf.runtime.config import Derived, TrainConfig, parse_key_values
from rlhf.runtime.data import DataSettings, PromptFormatter, PromptLoader, load_prompts
from rlhf.runtime.distributed import SINGLE, DistContext, init_from_environment
from rlhf.runtime.trainer import Trainer, Workers
from rlhf.runtime.rollout import EnvFactory, RolloutSettings, RolloutWorker
from rlhf.runtime.workers import (CriticWorker, PolicyObjective, PolicyWorker, ReferenceWorker, RewardWorker,
                                  UpdateSettings)


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


def build_workers(config: TrainConfig, derived: Derived, plugins: PluginSet, dist: DistContext = SINGLE) -> Workers:
    from rlhf.algorithms import resolve_algorithm, value_loss
    from rlhf.rewards import load_rewards

    seed_everything(config.seed)
    values = config.to_dict()
    overrides = parse_key_values(config.algo_config)

    algorithm = resolve_algorithm(config.algo, advantage=config.advantage, policy_loss=config.policy_loss,
                                  kl_estimator=config.kl_estimator, kl_coef=config.kl_coef, kl_in=config.kl_in,
                                  loss_agg=config.loss_agg, n_samples=config.n_samples, plugins=plugins)
    options = dataclasses.asdict(config.reward_options)
    reward_set = None
    if config.reward:
        reward_set = load_rewards(config.reward, plugins=plugins, on_error=options.pop("on_error"), **options)

    models = plugins.registry("model").component(config.model_adapter)
    adapter = models.load()(component_config(models.load_config_cls(), values, overrides))  # --algo-config too
    tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
    policy_model = adapter.load(config.model, role="policy")

    settings = DataSettings(paths=config.data, input_key=config.input_key, label_key=config.label_key,
                            probs=[float(p) for p in config.data_probs.split(",")] if config.data_probs else None,
                            split=config.data_split, apply_chat_template=config.apply_chat_template,
                            input_template=config.input_template, max_prompt_length=config.max_prompt_length,
                            max_samples=config.max_samples, seed=config.seed)
    loader = PromptLoader(load_prompts(settings), PromptFormatter(tokenizer, settings), seed=config.seed)
    total_steps = config.steps if config.steps is not None else max(1, len(loader) // config.prompts_per_step)
    optimizer_steps = total_steps * derived.optimizer_steps_per_step

    backends = plugins.registry("train_backend").component(config.backend)

    def backend_for(model: torch.nn.Module, lr: float) -> Any:
        backend_values = {**values, "lr": lr, "adam_betas": derived.adam_betas, "total_steps": optimizer_steps,
                          "warmup_steps": math.ceil(config.warmup_ratio * optimizer_steps)}
        return backends.load()(model, component_config(backends.load_config_cls(), backend_values))

    update = UpdateSettings(ppo_epochs=config.ppo_epochs, train_batch_size=derived.train_batch_size,
                            micro_batch_size=config.micro_batch_size, max_new_tokens=config.max_new_tokens,
                            seed=config.seed)
    policy_loss_config = component_config(algorithm.policy_loss_config_cls, values, overrides)
    objective = PolicyObjective(
        policy_loss=algorithm.policy_loss_fn,
        policy_loss_config=policy_loss_config,
        aggregate=algorithm.aggregate_fn, kl_estimator=algorithm.kl_estimator_fn,
        kl_in_loss=algorithm.kl_in == "loss" and algorithm.kl_coef > 0, kl_coef=algorithm.kl_coef,
        entropy_coef=config.entropy_coef, temperature=config.temperature,
    )
    policy = PolicyWorker(policy_model, backend_for(policy_model, config.lr), update, objective, dist)

    reference = None
    if algorithm.needs_reference:
        reference = ReferenceWorker(adapter.load(config.model, role="reference"), config.micro_batch_size,
                                    config.temperature, dist)
    critic = None
    if algorithm.needs_critic:
        critic_model = adapter.load(config.critic_model or config.model, role="critic")
        critic = CriticWorker(critic_model, backend_for(critic_model, config.critic_lr), update,
                              value_loss=value_loss, value_clip=config.value_clip, dist=dist)

    if config.save_critic and critic is None:
        import logging

        logging.getLogger(__name__).warning("--save-critic: algorithm %r trains no critic; none is saved", config.algo)

    engines = plugins.registry("rollout_engine").component(config.engine)
    engine = engines.load()(policy_model, tokenizer, component_config(engines.load_config_cls(), values))

    def export_policy(out_dir: Path) -> None:
        if not dist.is_main:
            return
        if hasattr(adapter, "save"):  # adapters may write their own layout (e.g. a LoRA adapter + merged model)
            adapter.save(policy_model, tokenizer, out_dir)
        else:
            policy_model.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
        if critic is not None and config.save_critic:  # --save-critic: <out>/critic, next to final/
            if hasattr(adapter, "save_critic"):
                adapter.save_critic(critic.model, tokenizer, derived.out_dir / "critic")
            else:
                critic.model.save_pretrained(derived.out_dir / "critic")

    rollout = RolloutWorker(engine, tokenizer, EnvFactory(plugins.registry("env"), {
        **values, **parse_key_values(config.env_config)}), RolloutSettings(
        env=config.env, max_turns=config.max_turns,
        max_total_tokens=config.max_total_tokens or config.max_prompt_length + config.max_turns * config.max_new_tokens))
    return Workers(
        policy=policy, rollout=rollout, reward=RewardWorker(reward_set) if reward_set is not None else None,
        reference=reference, critic=critic, tokenizer=tokenizer, loader=loader, algorithm=algorithm,
        advantage_config=component_config(algorithm.advantage_config_cls, values, overrides),
        pad_token_id=tokenizer.pad_token_id, fingerprint=plugin_fingerprint(plugins), export_policy=export_policy,
        rollout_logprobs=getattr(policy_loss_config, "correction", None) is not None, dist=dist,
    )


def train(config: TrainConfig, *, plugins: PluginSet | None = None) -> Path:
    """Run training with the local runtime; returns the run directory."""
    plugins = plugins or build_plugin_manager()
    if plugins.broken:
        import logging

        logging.getLogger(__name__).warning(
            "some plugins failed to load (see `rlhf plugins list`): %s", ", ".join(r.label for r in plugins.broken))
    derived = config.derived()
    dist = init_from_environment()
    for name, size in (("--prompts-per-step", config.prompts_per_step),
                       ("--train-batch-size", derived.train_batch_size)):
        if size % dist.world_size:
            raise ConfigError(f"{name} ({size}) must be a multiple of the number of processes ({dist.world_size})")
    if not config.reward and config.env == "single_turn":
        raise ConfigError("--reward is required (a reward function, URL or reward model) unless an --env gives "
                          "rewards; see `rlhf train --help`")
    workers = build_workers(config, derived, plugins, dist)
    return Trainer(config, derived, plugins, workers).run()
