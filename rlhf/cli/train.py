"""``rlhf train``: flags generated from `rlhf.runtime.config.TrainConfig`, one per field, plus
``--<slot>.<setting>`` for every setting of every registered component (``--backend.zero-stage``).

``--config run.yaml`` supplies defaults for the same names (keys with ``_`` or ``-``; component
settings as ``components: {backend: {zero_stage: 3}}``, ``backend.zero_stage`` or the short
alias ``zero_stage``); flags given on the command line override the file.

The command is built when it is used (``rlhf train ...``, ``rlhf train --help``), not when
``rlhf --help`` lists it: its component flags need every component's config class.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from rlhf.cli.options import SLOT_SEPARATOR, Flag, component_flags, config_flags, nullable_fields, split_settings

SHORT_HELP = "Train a policy with reinforcement learning."
_GROUP_TITLES = {"model": "Model", "data": "Data", "algorithm": "Algorithm", "rollout": "Rollout",
                 "reward": "Rewards", "train": "Optimisation", "runtime": "Runtime", "ray": "Ray",
                 "output": "Output"}


def train_flags(plugins: Any) -> list[Flag]:
    from rlhf.core.types import AdvantageConfig
    from rlhf.runtime.config import ALIASES, NESTED, SLOTS, TrainConfig

    return (config_flags(TrainConfig, nested=NESTED, titles=_GROUP_TITLES, skip=("components",))
            + component_flags(plugins, SLOTS, ALIASES, default_config={"advantage": AdvantageConfig}))


def _config_file_loader(flags: list[Flag]) -> Any:
    def load(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        """Eager callback: the YAML file becomes click's default_map, so explicit flags win."""
        if value is None:
            return None
        import yaml

        from rlhf.core.errors import ConfigError
        from rlhf.runtime.config import NESTED, gather_components

        try:
            loaded = yaml.safe_load(Path(value).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise click.BadParameter(f"cannot read {value}: {exc}", ctx, param) from None
        if not isinstance(loaded, dict):
            raise click.BadParameter(f"{value} must hold a mapping of option names to values", ctx, param)
        mapping = {str(key).replace("-", "_"): item for key, item in loaded.items()}
        for key in [k for k in mapping if k in NESTED and isinstance(mapping[k], dict)]:  # a nested group
            prefix = NESTED[key][0]
            mapping.update({f"{prefix}_{str(k).replace('-', '_')}": v for k, v in mapping.pop(key).items()})
        try:
            components = gather_components(mapping)
        except ConfigError as exc:
            raise click.BadParameter(f"{value}: {exc}", ctx, param) from None
        for slot, settings in components.items():
            mapping.update({f"{slot}{SLOT_SEPARATOR}{name}": item for name, item in settings.items()})
        names = {flag.dest for flag in flags}
        unknown = sorted(set(mapping) - names)
        if unknown:
            shown = [u.replace(SLOT_SEPARATOR, ".") for u in unknown]
            raise click.BadParameter(f"{value}: unknown option(s) {', '.join(shown)}", ctx, param)
        for flag in flags:
            if flag.multiple and isinstance(mapping.get(flag.dest), (str, int, float)):
                mapping[flag.dest] = [mapping[flag.dest]]
        ctx.default_map = {**(ctx.default_map or {}), **mapping}
        return value

    return load


def build_train_command(plugins: Any) -> click.Command:
    flags = train_flags(plugins)

    def command(**kwargs: Any) -> None:
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
        from rlhf.core.references import Resolved
        from rlhf.runtime.config import TrainConfig

        kwargs.pop("config_file")
        components = split_settings(kwargs)
        values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
        values = {k: (v.ref if isinstance(v, Resolved) else v) for k, v in values.items()}  # components: keep names
        values = {k: v for k, v in values.items() if v is not None or k in nullable_fields(TrainConfig)}
        if not values.get("model"):
            raise click.UsageError("--model is required (a local HF model directory or a hub name)")
        if not values.get("data"):
            raise click.UsageError("--data is required (a prompt dataset file, folder or hub name)")
        config = TrainConfig.from_dict({**values, "components": components})
        if config.ray_address and config.runtime != "ray":  # DESIGN §10: an address means the Ray runtime
            config = dataclasses.replace(config, runtime="ray")
        _quiet_library_progress_bars()
        state = click.get_current_context().find_object(CliState)
        if config.runtime == "ray":
            from rlhf.runtime.ray import train
        else:
            from rlhf.runtime.local import train
        out = train(config, plugins=state.plugins)
        click.echo(f"run finished: {out}")

    for flag in reversed(flags):
        command = flag.option()(command)
    command = click.option("--config", "config_file", type=click.Path(dir_okay=False),
                           callback=_config_file_loader(flags), is_eager=True, expose_value=True,
                           help="YAML file with option values (flags override it)")(command)
    return click.command("train", short_help=SHORT_HELP, context_settings={"max_content_width": 120})(command)


class LazyCommand(click.Command):
    """A command built on first use: listing it in ``rlhf --help`` needs only its short help."""

    def __init__(self, name: str, short_help: str, build: Any):
        super().__init__(name, short_help=short_help)
        self._build, self._command = build, None

    @property
    def command(self) -> click.Command:
        if self._command is None:
            self._command = self._build()
        return self._command

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        return self.command.make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        return self.command.invoke(ctx)

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return self.command.get_params(ctx)

    def get_help(self, ctx: click.Context) -> str:
        return self.command.get_help(ctx)


def train_command(plugins: Any) -> click.Command:
    return LazyCommand("train", SHORT_HELP, lambda: build_train_command(plugins))


def _quiet_library_progress_bars() -> None:
    """transformers and datasets draw their own bars (weights loading, splits); ours is the one that counts."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
