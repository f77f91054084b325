"""The pieces a generation job builds from plugins: the model adapter, the rollout engine, the
reward sources, the prompt data. Shared by ``rlhf generate`` and each round of ``rlhf iterate``."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf.core.plugin_host.settings import build_component_config
from rlhf.runtime.config.options import Slot


def component(plugins: Any, slot: Slot, name: str, settings: dict[str, Any], run_values: dict[str, Any]) -> Any:
    """``(factory, config)`` of the registered component ``name`` of ``slot``'s kind."""
    found = plugins.registry(slot.kind).component(name)
    config = build_component_config(found.load_config_cls(), settings=settings, run_values=run_values,
                                    who=f"the {found.name!r} {slot.kind.replace('_', ' ')}", flag=slot.flag)
    return found.load(), config


def sampling_components(config: Any, plugins: Any) -> tuple[tuple[Any, Any], tuple[Any, Any], dict[str, Any]]:
    """``((adapter factory, config), (engine factory, config), run values)`` of a sampling job
    (``rlhf generate``, ``rlhf eval``): the model adapter and the rollout engine it picked, their
    settings checked before anything loads."""
    from rlhf.datagen.config import GENERATE_SLOTS

    values, settings = run_values(config), config.components
    adapter = component(plugins, GENERATE_SLOTS["model_adapter"], config.model_adapter,
                        settings.get("model_adapter", {}), values)
    engine = component(plugins, GENERATE_SLOTS["engine"], config.engine, settings.get("engine", {}), values)
    return adapter, engine, values


def run_values(config: Any) -> dict[str, Any]:
    """What a generation job offers to its components' run fields (``rlhf.core.plugin_host.settings.RUN_VALUES``)."""
    return {"seed": config.seed, "model": config.model, "tokenizer": config.tokenizer or config.model,
            "dtype": config.dtype, "device": config.device, "trust_remote_code": config.trust_remote_code,
            "max_prompt_length": config.max_prompt_length, "max_new_tokens": config.max_new_tokens, "max_turns": 1,
            "max_total_tokens": config.max_prompt_length + config.max_new_tokens,
            "temperature": config.temperature, "lr": 0.0, "total_steps": 1, "micro_batch_size": 1,
            "synced_generation": False, "save_critic": False}


def load_reward_set(config: Any, plugins: Any) -> Any:
    """The ``--reward`` sources as one weighted `RewardSet` (None without ``--reward``)."""
    from rlhf.rewards import load_rewards

    if not config.reward:
        return None
    options = dataclasses.asdict(config.reward_options)
    return load_rewards(config.reward, plugins=plugins, on_error=options.pop("on_error"), **options)


def data_settings(config: Any) -> Any:
    from rlhf.runtime.run.data import DataSettings

    return DataSettings(paths=list(config.data), input_key=config.input_key, label_key=config.label_key,
                        probs=config.mixing_probs, split=config.data_split,
                        apply_chat_template=config.apply_chat_template, input_template=config.input_template,
                        max_prompt_length=config.max_prompt_length, max_samples=config.max_samples, seed=config.seed)
