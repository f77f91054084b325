"""Reward sources (docs/rewards.md): the host machinery that ``rlhf train --reward`` uses, and its public API.

Python functions called by signature (``calling.py``), remote HTTP servers speaking OpenRLHF's
protocol (``remote.py``, and ``server.py`` for ``rlhf reward serve``), reward models
(``reward_model.py``), their weighted combination and the failure policy (``combine.py``,
``failures.py``). Built-in reward functions are a plugin (``rlhf.plugins.rewards``). Light to
import: torch and aiohttp load only when a source that needs them scores.

    from rlhf.rewards import load_reward, load_rewards

    reward = load_reward("boxed_math")                      # or a URL, file.py:func, module:attr, a model dir
    reward.score(["What is 1/2 + 0?"], ["\\\\boxed{0.5}"], ["1/2"])   # [1.0]

    rewards = load_rewards(["boxed_math@1", "think_format@0.2"], on_error="skip")
    result = rewards.score(prompts, completions, labels, solution=labels)
    result.total, result.per_source, result.metrics

``score`` has an async twin ``ascore``; keyword arguments other than ``prompt_texts`` and
``completion_ids`` are dataset columns (one value per sample). Options are `RewardOptions` fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf.core.plugin_host.loading import PluginSet, installed_plugins
from rlhf.rewards.combine import RewardResult, RewardSet
from rlhf.rewards.failures import RewardConfigError, RewardError, RewardFailure
from rlhf.rewards.loading import build_set, build_source, split_weight
from rlhf.rewards.options import RewardOptions
from rlhf.rewards.source import RewardBatch, RewardSource

__all__ = [
    "RewardBatch", "RewardConfigError", "RewardError", "RewardFailure", "RewardOptions", "RewardResult",
    "RewardSet", "RewardSource", "load_reward", "load_rewards",
]

def _plugins(plugins: PluginSet | None) -> PluginSet:
    return installed_plugins(plugins)


def load_reward(spec: str, *, plugins: PluginSet | None = None, **options: Any) -> RewardSource:
    """One reward source from a SPEC: an ``http(s)://`` URL, a registered name, ``file.py[:func]``,
    ``module:attr`` or a reward-model directory. ``options`` are `RewardOptions` fields."""
    text, weight = split_weight(spec)
    if weight != 1.0 or text != spec.strip():
        raise RewardConfigError(f"load_reward takes one source without a weight; use load_rewards([{spec!r}])")
    return build_source(text, _plugins(plugins).registry("reward"), RewardOptions.from_kwargs(**options))


def load_rewards(specs: Sequence[str], *, plugins: PluginSet | None = None, on_error: str = "raise",
                 **options: Any) -> RewardSet:
    """Reward sources from ``SPEC[@WEIGHT]`` strings, combined as a weighted sum with one failure policy."""
    if isinstance(specs, str):
        specs = [specs]
    return build_set(list(specs), _plugins(plugins).registry("reward"),
                     RewardOptions.from_kwargs(on_error=on_error, **options))
