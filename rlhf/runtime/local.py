"""The embedded local runtime: every worker in this process, on one device (CPU or one GPU).

`train(config)` is what ``rlhf train`` calls; tests and notebooks call it directly too. Started
by a launcher (``torchrun --nproc-per-node N -m rlhf train ...``), each process is one
data-parallel rank running the same loop (rlhf/core/distributed.py).

The role builders below are shared with the Ray runtime, which calls each inside the actor that
holds the role, in the same order (so the same random numbers are drawn).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext, init_from_environment
from rlhf.core.errors import ConfigError
from rlhf.core.plugins import PluginSet, build_plugin_manager
from rlhf.runtime.config import TrainConfig
from rlhf.runtime.data import DataSettings, PromptFormatter, PromptLoader, load_prompts
from rlhf.runtime.export import export_critic, export_policy
from rlhf.runtime.plan import RunPlan, check_run, warn_about
from rlhf.runtime.rollout import EnvFactory, RolloutSettings, RolloutWorker
from rlhf.runtime.run_dir import RunDirectory
from rlhf.runtime.threads import set_threads
from rlhf.runtime.trainer import Trainer, Workers
from rlhf.runtime.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker, UpdateSettings

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --- one builder per role -------------------------------------------------------------------


def update_settings(plan: RunPlan) -> UpdateSettings:
    config = plan.config
    return UpdateSettings(ppo_epochs=config.ppo_epochs, train_batch_size=plan.derived.train_batch_size,
                          micro_batch_size=config.micro_batch_size, max_new_tokens=config.max_new_tokens,
                          max_tokens_per_micro_batch=config.max_tokens_per_micro_batch, packing=config.packing,
                          seed=config.seed)


def build_adapter(plan: RunPlan) -> Any:
    return plan.choices["model_adapter"].load()(plan.component_config("model_adapter"))


def build_backend(plan: RunPlan, model: torch.nn.Module, lr: float) -> Any:
    return plan.choices["backend"].load()(model, plan.component_config("backend", lr=lr))


def build_policy(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE) -> PolicyWorker:
    config = plan.config
    model = adapter.load(config.model, role="policy")
    objective = plan.algorithm.policy_objective(plan.policy_loss_config, entropy_coef=config.entropy_coef,
                                                temperature=config.temperature)
    return PolicyWorker(model, build_backend(plan, model, config.lr), update_settings(plan), objective, dist)


def build_reference(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE) -> ReferenceWorker:
    config = plan.config
    return ReferenceWorker(adapter.load(config.model, role="reference"), config.micro_batch_size,
                           config.temperature, dist, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                           packing=config.packing)


def build_critic(plan: RunPlan, adapter: Any, dist: DistContext = SINGLE) -> CriticWorker:
    config = plan.config
    model = adapter.load(config.critic_model or config.model, role="critic")
    return CriticWorker(model, build_backend(plan, model, config.critic_lr), update_settings(plan),
                        plan.algorithm.value_objective(config.value_clip), dist)


def build_rollout(plan: RunPlan, plugins: PluginSet, model: torch.nn.Module, tokenizer: Any, *,
                  synced_generation: bool = False) -> RolloutWorker:
    """``synced_generation``: ``model`` is a trained policy whose forwards are collectives over its
    ranks (a backend that ``shards_weights``, e.g. DeepSpeed ZeRO-3), so ranks decode in lockstep."""
    config = plan.config
    if synced_generation and plan.env_capability("multi_turn"):
        raise ConfigError(f"--env {config.env} with --zero-stage 3 on several ranks is not supported yet: every rank "
                          "must make the same generate calls; use --zero-stage 2, or one process")
    engine_config = plan.component_config("engine", synced_generation=synced_generation)
    engine = plan.choices["engine"].load()(model, tokenizer, engine_config)
    envs = EnvFactory(plugins.registry("env"), plan.env_settings, plan.run_values())
    return RolloutWorker(engine, tokenizer, envs, RolloutSettings(env=config.env, max_turns=config.max_turns,
                                                                  max_total_tokens=plan.token_budget))


def build_reward(config: TrainConfig, plugins: PluginSet) -> RewardWorker:
    """The reward sources (none when the environment gives every reward)."""
    from rlhf.rewards import load_rewards

    if not config.reward:
        return RewardWorker(None)
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
    """The final policy to ``out_dir`` and, with ``--save-critic``, the critic to ``<out>/critic``."""
    export_policy(adapter, tokenizer, policy, out_dir, dist)
    if critic is not None and plan.config.save_critic:
        export_critic(adapter, tokenizer, critic, plan.derived.out_dir / "critic", dist)


def build_workers(plan: RunPlan, plugins: PluginSet, dist: DistContext = SINGLE) -> tuple[Workers, RunPlan]:
    """Every role in this process, and the plan completed with the data's size."""
    config = plan.config
    seed_everything(config.seed)
    reward = build_reward(config, plugins)
    adapter = build_adapter(plan)
    tokenizer = adapter.load_tokenizer(config.tokenizer or config.model)
    loader = build_loader(config, tokenizer)
    plan = plan.with_prompts(len(loader))

    policy = build_policy(plan, adapter, dist)
    reference = build_reference(plan, adapter, dist) if plan.algorithm.needs_reference else None
    critic = build_critic(plan, adapter, dist) if plan.algorithm.needs_critic else None
    rollout = build_rollout(plan, plugins, policy.model, tokenizer,
                            synced_generation=policy.backend.shards_weights and dist.active)
    workers = Workers(
        policy=policy, rollout=rollout, reward=reward, reference=reference, critic=critic, loader=loader,
        pad_token_id=tokenizer.pad_token_id, dist=dist,
        export=lambda out_dir: export_final(plan, adapter, tokenizer, policy, critic, out_dir, dist),
    )
    return workers, plan


def train(config: TrainConfig, *, plugins: PluginSet | None = None) -> Path:
    """Run training with the local runtime; returns the run directory."""
    plugins = plugins or build_plugin_manager()
    plan = RunPlan.make(config, plugins)
    dist = init_from_environment()
    workers = None
    try:
        check_run(plan, world_size=dist.world_size)
        if dist.is_main:
            RunDirectory(plan.derived.out_dir).check_free(resume=config.resume)
        warn_about(plan, plugins, log)
        set_threads(config.threads)
        workers, plan = build_workers(plan, plugins, dist)
        return Trainer(plan, plugins, workers).run()
    finally:
        del workers  # the models and their backends (which hold process groups) go before the group does
        dist.close()
