"""Contract of a reward shaping (``register_reward_shapings``): ``(trajectories, rewards, config) ->
(rewards, metrics)`` returns one reward per trajectory, a finite number where one was given and None
where the sample was dropped (None stays None); it does not change its input list; its metrics are
finite numbers under namespaced keys; it is deterministic."""

from __future__ import annotations

import math
from typing import Any

from rlhf.plugin_kit.checks.target import Target, finite_number

# (policy tokens, environment tokens, finish reason, reward)
SAMPLES = [(2, 0, "stop", 1.0), (8, 0, "length", 0.5), (3, 5, "stop", 0.0), (8, 0, "budget", None),
           (7, 0, "stop", -1.0)]


def _trajectories() -> list[Any]:
    from rlhf.core.types import Trajectory

    out = []
    for index, (policy, environment, finish, _) in enumerate(SAMPLES):
        mask = [0, 0] + [1] * policy + [0] * environment
        out.append(Trajectory(token_ids=list(range(len(mask))), loss_mask=mask, prompt_length=2, prompt="p",
                              prompt_text="p", completion_text="x" * (policy + environment), group=index,
                              finish_reason=finish, columns={"answer": "1"}, label="1"))
    return out


def _enabled_config(target: Target) -> Any:
    """The config a run builds when it turns the shaping on by its ``enabled_by`` setting (set to a
    small sample value of its type: 4, 0.5 or true), else the default one."""
    import typing

    from rlhf.core.plugin_host.settings import setting_fields

    name = target.capabilities.get("enabled_by")
    fields = {f.name for f in setting_fields(target.config_cls)}
    if name and name in fields:
        hint = typing.get_type_hints(target.config_cls)[name]
        for sample in (4, 0.5, True):
            if isinstance(sample, int) and not isinstance(sample, bool) and int not in (hint, *typing.get_args(hint)):
                continue
            if isinstance(sample, float) and float not in (hint, *typing.get_args(hint)):
                continue
            try:
                return target.config({name: sample})
            except Exception:  # noqa: BLE001 - that sample is out of the setting's range; try the next
                continue
    return target.config()


def check(target: Target) -> list[str]:
    config = _enabled_config(target)
    rewards = [reward for *_, reward in SAMPLES]

    def run(what: str) -> tuple[list[Any], dict[str, Any]]:
        given = list(rewards)
        try:
            result = target.obj(_trajectories(), given, config)
        except Exception as exc:
            raise target.fail(f"raised {type(exc).__name__}: {exc} ({what})") from exc
        if given != rewards:
            raise target.fail("changed the list of rewards it was given; return a new list")
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
            raise target.fail("must return (rewards, metrics): a list and a dict")
        shaped, metrics = list(result[0]), result[1]
        if len(shaped) != len(rewards):
            raise target.fail(f"returned {len(shaped)} rewards for {len(rewards)} trajectories")
        return shaped, metrics

    shaped, metrics = run("five samples")
    for index, (before, after) in enumerate(zip(rewards, shaped)):
        if before is None and after is not None:
            raise target.fail(f"sample {index} was dropped (reward None) and came back as {after!r}; keep it None")
        if before is not None and not finite_number(after):
            raise target.fail(f"sample {index}: the shaped reward must be a finite number, got {after!r}")
    lines = ["one reward per trajectory; finite numbers, None kept None"]
    for key, value in metrics.items():
        if "/" not in key:
            raise target.fail(f"metric {key!r} needs a namespace, e.g. 'my_shaping/{key}'")
        if not finite_number(value):
            raise target.fail(f"metric {key!r} must be a finite number, got {value!r}")
    lines.append(f"{len(metrics)} metric(s), finite and namespaced")
    again, _ = run("the same samples again")
    if any(not (a == b or (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b)))
           for a, b in zip(again, shaped)):
        raise target.fail("gave other rewards for the same samples: a shaping must be deterministic")
    lines.append("deterministic, input list unchanged")
    return lines
