"""``rlhf train``: flags are generated from `rlhf.runtime.config.TrainConfig`, one per field.

``--config run.yaml`` supplies defaults for the same fields (keys with ``_`` or ``-``); flags
given on the command line override the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import click

from rlhf.cli.params import ComponentParam

_GROUP_TITLES = {"model": "Model", "data": "Data", "algorithm": "Algorithm", "rollout": "Rollout",
                 "reward": "Rewards", "train": "Optimisation", "runtime": "Runtime", "ray": "Ray",
                 "output": "Output"}


@dataclasses.dataclass(frozen=True)
class _Flag:
    name: str  # flat name: a TrainConfig field, or "<prefix>_<field>" of a nested group
    field: dataclasses.Field
    hint: Any
    group: str


def _config_fields() -> list[_Flag]:
    """One entry per flag, nested option groups flattened with their prefix."""
    from rlhf.runtime.config import NESTED, TrainConfig

    flags = []
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in NESTED:
            prefix, group_cls = NESTED[f.name]
            sub_hints = typing.get_type_hints(group_cls)
            flags += [_Flag(f"{prefix}_{sub.name}", sub, sub_hints[sub.name], f.metadata["group"])
                      for sub in dataclasses.fields(group_cls)]
        else:
            flags.append(_Flag(f.name, f, hints[f.name], f.metadata["group"]))
    return flags


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int, ``list[str]`` -> list; Literal types are kept whole."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint if typing.get_origin(hint) is typing.Literal else typing.get_origin(hint) or hint


def _option(spec: _Flag) -> Any:
    f, name = spec.field, spec.name
    flag = "--" + name.replace("_", "-")
    meta = f.metadata
    help_text = f"[{_GROUP_TITLES[spec.group]}] {meta['help']}"
    base = _base_type(spec.hint)
    if base is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=f.default, show_default=True, help=help_text)
    if meta.get("multiple"):
        return click.option(flag, name, multiple=True, help=help_text)
    if "component" in meta:
        kind = ComponentParam(meta["component"])
    elif "choices" in meta:
        kind = click.Choice(meta["choices"])
    elif typing.get_origin(base) is typing.Literal:
        kind = click.Choice(typing.get_args(base))
    else:
        kind = {int: int, float: float}.get(base, str)
    default = None if f.default is dataclasses.MISSING or f.default == "" else f.default
    return click.option(flag, name, type=kind, default=default, show_default=default is not None, help=help_text)


def _load_config_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Eager callback: the YAML file becomes click's default_map, so explicit flags win."""
    if value is None:
        return None
    import yaml

    try:
        loaded = yaml.safe_load(Path(value).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise click.BadParameter(f"cannot read {value}: {exc}", ctx, param) from None
    if not isinstance(loaded, dict):
        raise click.BadParameter(f"{value} must hold a mapping of option names to values", ctx, param)
    from rlhf.runtime.config import NESTED

    names = {spec.name for spec in _config_fields()}
    mapping = {}
    for key, value in loaded.items():
        key = str(key).replace("-", "_")
        if key in NESTED and isinstance(value, dict):  # a nested group written as a mapping
            prefix = NESTED[key][0]
            mapping.update({f"{prefix}_{str(k).replace('-', '_')}": v for k, v in value.items()})
        else:
            mapping[key] = value
    unknown = sorted(set(mapping) - names)
    if unknown:
        raise click.BadParameter(f"{value}: unknown option(s) {', '.join(unknown)}", ctx, param)
    for key in ("data", "reward", "algo_config"):
        if key in mapping and isinstance(mapping[key], str):
            mapping[key] = [mapping[key]]
    ctx.default_map = {**(ctx.default_map or {}), **mapping}
    return value


def _train_command() -> click.Command:
    def command(**kwargs: Any) -> None:
        """Train a policy with reinforcement learning (this process, torchrun ranks, or Ray actors).

        \b
        rlhf train --algo grpo --model ./examples/tiny-model --data examples/data/train.jsonl \\
            --label-key answer --reward examples/rewards.py:exact_match --out runs/quickstart
        python -m torch.distributed.run --standalone --nproc-per-node 2 -m rlhf train ...
        rlhf train --runtime ray --policy-actors 2 ...

        Every option can also come from --config run.yaml (flags override the file).
        """
        from rlhf.cli.state import CliState
        from rlhf.runtime.config import TrainConfig

        kwargs.pop("config_file")
        values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
        values = {k: (v.ref if hasattr(v, "ref") else v) for k, v in values.items()}  # components: keep names
        values = {k: v for k, v in values.items() if v is not None or k in _nullable()}
        if not values.get("model"):
            raise click.UsageError("--model is required (a local HF model directory or a hub name)")
        if not values.get("data"):
            raise click.UsageError("--data is required (a prompt dataset file, folder or hub name)")
        config = TrainConfig.from_dict(values)
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

    for spec in reversed(_config_fields()):
        command = _option(spec)(command)
    command = click.option("--config", "config_file", type=click.Path(dir_okay=False), callback=_load_config_file,
                           is_eager=True, expose_value=True, help="YAML file with option values (flags override it)")(
        command)
    return click.command("train", context_settings={"max_content_width": 120})(command)


def _quiet_library_progress_bars() -> None:
    """transformers and datasets draw their own bars (weights loading, splits); ours is the one that counts."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _nullable() -> set[str]:
    return {spec.name for spec in _config_fields() if type(None) in typing.get_args(spec.hint)}


train_command = _train_command()
