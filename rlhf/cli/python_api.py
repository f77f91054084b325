"""rlhf's Python API: each command as a function whose keyword arguments are the command's options.

    from rlhf import train
    result = train(algo="grpo", model="./examples/tiny-model", data="examples/data/train.jsonl",
                   label_key="answer", reward="examples/rewards.py:exact_match", steps=50, out="runs/nb")
    result.metrics["reward/mean"], result.final

A call runs the command the CLI runs, through the same click command: the same options (a flag's
name with ``_`` for ``-``: ``n_samples=8``; a component setting as ``backend__zero_stage=3``, its
short name ``zero_stage=3`` or ``components={"backend": {"zero_stage": 3}}``; ``config="run.yaml"``
for a config file, which the keywords override as flags do), the same conversions and checks (an
error is the `rlhf.core.errors.ConfigError` the CLI prints as its one line), the same run directory
and plugins. What the CLI prints at the end is the function's result instead: a
`rlhf.cli.run_result.RunResult` for the training commands, the report of ``generate`` and
``evaluate``. Ctrl-C (a notebook's interrupt) stops the run as on the command line: the run saves
its step and raises `rlhf.core.errors.RunInterrupted` (a KeyboardInterrupt) naming how to resume.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import click

from rlhf.cli.commands import API_CALL, API_GIVEN
from rlhf.cli.options import SLOT_SEPARATOR
from rlhf.core.errors import ConfigError

# function name -> command name
COMMANDS = {"train": "train", "sft": "sft", "rm": "rm", "dpo": "dpo", "kto": "kto", "prm": "prm",
            "distill": "distill", "generate": "generate", "evaluate": "eval"}


@functools.lru_cache(maxsize=1)
def _plugins() -> Any:
    from rlhf.core.plugin_host.loading import build_plugin_manager

    return build_plugin_manager()


@functools.lru_cache(maxsize=None)
def _command(name: str) -> click.Command:
    plugins = _plugins()
    if name == "train":
        from rlhf.cli.train import build_train_command

        return build_train_command(plugins)
    if name in ("generate", "eval", "score", "iterate"):
        from rlhf.cli.generate import build_datagen_command

        return build_datagen_command(plugins, name)
    from rlhf.cli.fit import build_fit_command

    return build_fit_command(plugins, plugins.registry("objective").component(name))


def option_names(command: click.Command) -> dict[str, str]:
    """Keyword -> click parameter name: the parameter's own name (``n_samples``,
    ``backend__zero_stage``) and each of its flags with ``_`` for ``-`` (``zero_stage``,
    ``backend.zero_stage``, an OpenRLHF alias's name), ``config`` for ``--config``."""
    names: dict[str, str] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        names[param.name] = param.name
        for opt in param.opts:
            names.setdefault(opt.lstrip("-").replace("-", "_"), param.name)
    names["config"] = "config_file"
    return names


def _value(param: click.Parameter, value: Any) -> Any:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if param.multiple:
        items = [value] if isinstance(value, (str, int, float, bool)) else list(value)
        return [os.fspath(v) if isinstance(v, os.PathLike) else v for v in items]
    return value


def _given(command: click.Command, name: str, options: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``(config file, {parameter: value})`` of a call's keywords; unknown ones are a `ConfigError`."""
    names = option_names(command)
    params = {p.name: p for p in command.params}
    flat: dict[str, Any] = {}
    for key, value in options.items():
        if key == "components":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}(components=...) must map slots to settings, e.g. "
                                  "{'backend': {'zero_stage': 3}}")
            for slot, settings in value.items():
                if not isinstance(settings, Mapping):
                    raise ConfigError(f"{name}(components={{{slot!r}: ...}}) must map option names to values")
                for setting, item in settings.items():
                    flat[f"{slot}{SLOT_SEPARATOR}{str(setting).replace('-', '_')}"] = item
            continue
        flat[str(key)] = value
    config, given = None, {}
    for key, value in flat.items():
        dest = names.get(key.replace("-", "_"))
        if dest is None:
            from rlhf.core.errors import close_matches

            hint = close_matches(key, sorted(k for k in names if "." not in k), n=1)
            raise ConfigError(f"{name}() got an unknown option {key!r}"
                              + (f"; did you mean {hint[0]!r}?" if hint else "")
                              + f" (`rlhf {COMMANDS.get(name, name)} --help` lists the options)")
        if dest == "config_file":
            config = os.fspath(value) if value is not None else None
            continue
        if value is None:
            continue
        value = _value(params[dest], value)
        if dest in given and given[dest] != value:
            raise ConfigError(f"{name}(): {key} is given twice, as {given[dest]!r} and {value!r}")
        given[dest] = value
    return config, given


def call(name: str, options: Mapping[str, Any]) -> Any:
    """Run the command ``COMMANDS[name]`` with ``options`` as its keyword options; its result."""
    from rlhf.cli.state import CliState
    from rlhf.runtime.notices import quiet_library_notices
    from rlhf.runtime.run.threads import prepare_openmp

    prepare_openmp()  # as `rlhf` does, before anything imports torch
    quiet_library_notices()
    command_name = COMMANDS.get(name, name)
    command = _command(command_name)
    config, given = _given(command, name, options)
    ctx = command.context_class(command, info_name=command_name, obj=CliState(_plugins()), default_map=dict(given),
                                **command.context_settings)
    ctx.meta[API_CALL] = True
    ctx.meta[API_GIVEN] = given
    try:
        with ctx.scope(cleanup=False):
            command.parse_args(ctx, ["--config", config] if config else [])
        with ctx:
            return command.invoke(ctx)
    except click.UsageError as exc:  # a value click refused, --model missing: the CLI's one line
        raise ConfigError(_api_words(exc.format_message())) from None


def _api_words(message: str) -> str:
    """Click names options as flags (``'--lr'``); the caller wrote keywords."""
    import re

    return re.sub(r"'--([a-z0-9][a-z0-9.-]*)'", lambda m: repr(m.group(1).replace("-", "_")), message)


# --- the functions `from rlhf import ...` gives ---------------------------------------------------


def train(**options: Any) -> Any:
    """Train a policy with RL, as ``rlhf train``; returns a `RunResult` (``out``, ``final``, ``metrics``).

    ``train(algo="grpo", model=..., data=..., reward=..., steps=50, out="runs/x")``; every option of
    ``rlhf train --help`` by its name with ``_`` (``n_samples=8``, ``zero_stage=3``,
    ``components={"policy_loss": {"clip_high": 0.28}}``, ``config="run.yaml"``)."""
    return call("train", options)


def sft(**options: Any) -> Any:
    """Supervised fine-tuning, as ``rlhf sft``; returns a `RunResult`."""
    return call("sft", options)


def rm(**options: Any) -> Any:
    """Train a reward model on preference pairs, as ``rlhf rm``; returns a `RunResult`."""
    return call("rm", options)


def dpo(**options: Any) -> Any:
    """Direct preference optimisation, as ``rlhf dpo``; returns a `RunResult`."""
    return call("dpo", options)


def kto(**options: Any) -> Any:
    """KTO on desirable / undesirable examples, as ``rlhf kto``; returns a `RunResult`."""
    return call("kto", options)


def prm(**options: Any) -> Any:
    """Train a process reward model, as ``rlhf prm``; returns a `RunResult`."""
    return call("prm", options)


def distill(**options: Any) -> Any:
    """Distil a teacher into a student, as ``rlhf distill``; returns a `RunResult`."""
    return call("distill", options)


def generate(**options: Any) -> Any:
    """Sample, score and write JSONL, as ``rlhf generate``; returns its report (``out``, ``rows``, ...)."""
    return call("generate", options)


def evaluate(**options: Any) -> Any:
    """A model's eval metrics on prompts, as ``rlhf eval``; returns its report (``metrics``, ``rows``)."""
    return call("evaluate", options)


FUNCTIONS = ("train", "sft", "rm", "dpo", "kto", "prm", "distill", "generate", "evaluate")
