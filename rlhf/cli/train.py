"""``rlhf train``: flags generated from `rlhf.runtime.config.train_config.TrainConfig`, one per field, plus
``--<slot>.<setting>`` for every setting of every registered component (``--backend.zero-stage``).

``--config run.yaml`` supplies defaults for the same names (keys with ``_`` or ``-``; component
settings as ``components: {backend: {zero_stage: 3}}``, ``backend.zero_stage`` or the short
alias ``zero_stage``); flags given on the command line override the file.

The command is built when it is used (``rlhf train ...``, ``rlhf train --help``), not when
``rlhf --help`` lists it: its component flags need every component's config class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from rlhf.cli.commands import (LazyCommand, config_file_option, config_values, model_prompt_format, preflight,
                               quiet_library_progress_bars, report)
from rlhf.cli.options import Flag, component_flags, config_flags

SHORT_HELP = "Train a policy with reinforcement learning."
_GROUP_TITLES = {"model": "Model", "data": "Data", "algorithm": "Algorithm", "rollout": "Rollout",
                 "failures": "Failures", "reward": "Rewards", "filter": "Sample filter", "train": "Optimisation",
                 "eval": "Eval", "runtime": "Runtime", "ray": "Ray", "output": "Output"}


def train_flags(plugins: Any) -> list[Flag]:
    from rlhf.core.protocols.agent import AgentConfig
    from rlhf.core.types import AdvantageConfig
    from rlhf.runtime.config.train_config import NESTED, SETTING_SLOTS, TrainConfig

    return (config_flags(TrainConfig, nested=NESTED, titles=_GROUP_TITLES, skip=("components",))
            + component_flags(plugins, SETTING_SLOTS, TrainConfig.short_flags(plugins),
                              default_config={"advantage": AdvantageConfig, "agent": AgentConfig}))


def build_train_command(plugins: Any) -> click.Command:
    flags = train_flags(plugins)

    def command(**kwargs: Any) -> Any:
        """Train a policy with reinforcement learning (this process, torchrun ranks, or Ray actors).

        \b
        rlhf train --algo grpo --model ./examples/tiny-model --data examples/data/train.jsonl \\
            --label-key answer --reward examples/rewards.py:exact_match --out runs/quickstart
        python -m torch.distributed.run --standalone --nproc-per-node 2 -m rlhf train ...
        rlhf train --runtime ray --policy-actors 2 ...

        Every option can also come from --config run.yaml (flags override the file). A component's
        own options are --<slot>.<option> (e.g. --backend.zero-stage 3, --policy-loss.clip-high 0.28);
        `rlhf plugins show NAME` lists them.
        """
        from rlhf.cli.state import CliState
        from rlhf.runtime.config.train_config import TrainConfig

        values = config_values(kwargs, TrainConfig)
        if not values.get("model"):
            raise click.UsageError("--model is required (a local HF model directory or a hub name)")
        model_prompt_format(values, values["model"])
        if not values.get("data"):
            raise click.UsageError("--data is required (a prompt dataset file, folder or hub name)")
        state = click.get_current_context().find_object(CliState)
        config = TrainConfig.from_dict(values, state.plugins)
        if config.ray_address and config.runtime != "ray":  # docs/architecture.md: an address means the Ray runtime
            config = dataclasses.replace(config, runtime="ray")
        preflight(config, state.plugins, lambda: before_models(config, state.plugins))  # before torch loads
        quiet_library_progress_bars()
        if config.runtime == "ray":
            from rlhf.runtime.ray import train
        else:
            from rlhf.runtime.rl.local import train
        from rlhf.cli.run_result import RunResult

        out = train(config, plugins=state.plugins)
        report(f"run finished: {out}")
        return RunResult.of(out)

    from rlhf.runtime.config.train_config import TrainConfig

    for flag in reversed(flags):
        command = flag.option()(command)
    command = config_file_option(flags, TrainConfig)(command)
    from rlhf.cli.openrlhf_names import OpenRLHFNames

    return click.command("train", cls=OpenRLHFNames, short_help=SHORT_HELP,
                         context_settings={"max_content_width": 120})(command)


def before_models(config: Any, plugins: Any) -> None:
    """What a training run checks before it loads a model, in its order, without torch (`preflight`
    calls it before it says that a model path is wrong): the hub names of ``--critic-model``,
    ``--teacher`` and ``--reward`` (`rlhf.runtime.config.train_plan.RunPlan.check_model_refs`; here
    ``--critic-model`` whatever the algorithm), the ``--out`` folder, the rewards and their labels."""
    from rlhf.cli.commands import check_reward_labels, check_run_out
    from rlhf.core.hub import check_model_option
    from rlhf.rewards.loading import check_hub_reward_models
    from rlhf.runtime.run.run_files import TRAINING

    for flag, ref in (("--critic-model", config.critic_model), ("--teacher", config.teacher)):
        if ref:
            check_model_option(ref, flag)
    check_hub_reward_models(config.reward, plugins.registry("reward"))
    check_run_out(config.out, TRAINING)
    check_reward_labels(config, plugins)


def train_command(plugins: Any) -> click.Command:
    return LazyCommand("train", SHORT_HELP, lambda: build_train_command(plugins))
