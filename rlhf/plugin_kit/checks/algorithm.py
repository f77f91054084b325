"""Contract of an algorithm preset (``register_algorithms``): every piece it names is a component
the installed plugins provide, and its KL placement is one of ``reward``, ``loss``, ``none``."""

from __future__ import annotations

from rlhf.plugin_kit.checks.target import Target


def check(target: Target) -> list[str]:
    preset = target.obj
    if preset.kl_in not in ("reward", "loss", "none"):
        raise target.fail(f"kl_in should be 'reward', 'loss' or 'none', got {preset.kl_in!r}")
    if target.plugins is None:
        return ["kl_in is valid (no plugin set to resolve the pieces)"]
    pieces = (("advantage_estimator", preset.advantage), ("policy_loss", preset.policy_loss),
              ("kl_estimator", preset.kl_estimator), ("loss_aggregation", preset.loss_agg))
    for kind, name in pieces:
        try:
            target.plugins.registry(kind).get(name)
        except Exception as exc:
            raise target.fail(f"names {kind.replace('_', ' ')} {name!r}, which cannot be used: {exc}") from exc
    return ["names " + ", ".join(f"{k.replace('_', ' ')} {n!r}" for k, n in pieces) + ": all installed"]
