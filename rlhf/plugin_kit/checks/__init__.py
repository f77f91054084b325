"""The contract check of each component kind, one module per kind, found through `CHECKS`.

A check module defines ``check(target: Target) -> list[str]``: it exercises the component on CPU
with small synthetic inputs, returns what it verified (one line each) and raises `ContractError`
with a precise message at the first broken promise. To add the check of a new kind, write
``rlhf/plugin_kit/checks/<kind>.py`` and add one line to `CHECKS` below.
"""

from __future__ import annotations

import importlib
from typing import Callable

from rlhf.plugin_kit.checks.target import ContractError, Target

__all__ = ["CHECKS", "ContractError", "Target", "check_for"]

# kind name (rlhf.core.plugin_host.kinds.KINDS) -> the module under rlhf.plugin_kit.checks that checks it
CHECKS: dict[str, str] = {
    "advantage_estimator": "advantage_estimator",
    "policy_loss": "policy_loss",
    "kl_estimator": "kl_estimator",
    "loss_aggregation": "loss_aggregation",
    "algorithm": "algorithm",
    "reward": "reward",
    "env": "env",
    "model": "model",
    "rollout_engine": "rollout_engine",
    "train_backend": "train_backend",
    "objective": "objective",
    "sample_filter": "sample_filter",
    "reward_shaping": "reward_shaping",
    "agent": "agents.agent",
    "tool_parser": "agents.tool_parser",
}


def check_for(kind: str) -> Callable[[Target], list[str]] | None:
    """The check function of a kind (its module imported now), or None when the kind has none."""
    module = CHECKS.get(kind)
    if module is None:
        return None
    return importlib.import_module(f"{__name__}.{module}").check
