"""Contract of an environment (``register_envs``): a scripted episode (the class's
``sample_actions``) checking every return value, that the episode ends and that the class pickles
(`rlhf.core.protocols.environment.check_env`)."""

from __future__ import annotations

from rlhf.plugin_kit.checks.target import Target


def check(target: Target) -> list[str]:
    from rlhf.core.protocols.environment import EnvContractError, check_env

    config = target.config()
    try:
        return check_env(target.obj, config=config, name=target.name)
    except EnvContractError as exc:
        raise target.fail(f"breaks the environment contract: {exc}") from exc
