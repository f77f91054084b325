"""rlhf's Python API: each command as a function whose keyword arguments are the command's options.

    from rlhf import train
    result = train(algo="grpo", model="./examples/tiny-model", data="examples/data/train.jsonl",
                   label_key="answer", reward="examples/rewards.py:exact_match", steps=50, out="runs/nb")
    result.metrics["reward/mean"], result.final

A call runs the command the CLI runs, through the same click command: the same options (a flag's
name with ``_`` for ``-``: ``n_samples=8``; a component setting as ``backend__zero_stage=3``, its
short name ``zero_stage=3`` or ``components={"backend": {"zero_stage": 3}}``; ``config="run.yaml"``
for a config file, which the keywords override as flags do; OpenRLHF's names as the CLI takes
them: ``pretrain=``, ``n_samples_per_prompt=``, ``save_steps=-1``, each noted once with the native
name), the same conversions and checks (an
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


def _given(command: click.Command, name: str,
           options: Mapping[str, Any]) -> tuple[str | None, dict[str, Any], list[str]]:
    """``(config file, {parameter: value}, OpenRLHF words)`` of a call's keywords: OpenRLHF's names
    (`openrlhf_words`) become the command-line words the CLI would read, so the command rewrites
    them exactly as it rewrites its flags; other unknown keywords are a `ConfigError`."""
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
    config, given, words = None, {}, []
    aliased: dict[str, tuple[str, Any]] = {}  # native parameter -> (OpenRLHF keyword, value)
    for key, value in flat.items():
        dest = names.get(key.replace("-", "_"))
        alias = openrlhf_words(command, key, value, names) if dest is None else None
        if alias is not None:
            native, more = alias
            if native is not None:
                aliased[native] = (key, value)
            words += more
            continue
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
    for dest, (key, value) in aliased.items():
        if dest in given and given[dest] != _value(params[dest], value):
            raise ConfigError(f"{name}(): {key}= is OpenRLHF's name of {dest}=, and both are given "
                              f"({value!r} and {given[dest]!r}): give one")
    return config, given, words


def openrlhf_words(command: click.Command, key: str, value: Any,
                   names: Mapping[str, str]) -> tuple[str | None, list[str]] | None:
    """An OpenRLHF name the command answers to (``pretrain``, ``n_samples_per_prompt``,
    ``rollout.n_samples_per_prompt``; rlhf/cli/openrlhf_names.py) as the words of its flag:
    ``--pretrain VALUE`` (one per item of a list), ``--bf16`` for True (False: no words), with the
    parameter it sets when that is one native option; None when ``key`` is no such name."""
    from rlhf.cli.openrlhf_names import IGNORED, NODES, OpenRLHFNames, _lookup

    if not isinstance(command, OpenRLHFNames):
        return None
    flag = "--" + key
    ctx = click.Context(command, info_name=command.name)
    native_words = _lookup(flag, command.aliases(ctx))
    if native_words is None and key not in IGNORED and not (key in NODES and command.name == "train"):
        return None
    if native_words is not None and native_words[-1].startswith("--") and not _takes_value(command, native_words[-1]):
        return None, ([flag] if value is True else [])
    if native_words is not None and not native_words[-1].startswith("--"):  # --bf16: --dtype bf16
        return None, ([flag] if value is True else [])
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    words = [word for item in items for word in (flag, os.fspath(item) if isinstance(item, os.PathLike)
                                                 else str(item))]
    native = (names.get(native_words[0].lstrip("-").replace("-", "_"))
              if native_words is not None and len(native_words) == 1 else None)
    return native, words


def _takes_value(command: click.Command, flag: str) -> bool:
    """Whether ``flag`` (a native option or its ``--no-`` side) is followed by a value."""
    for param in command.params:
        if isinstance(param, click.Option) and flag in (*param.opts, *param.secondary_opts):
            return not param.is_flag
    return True


def call(name: str, options: Mapping[str, Any]) -> Any:
    """Run the command ``COMMANDS[name]`` with ``options`` as its keyword options; its result."""
    from rlhf.cli.state import CliState
    from rlhf.runtime.notices import quiet_library_notices
    from rlhf.runtime.run.threads import prepare_openmp

    prepare_openmp()  # as `rlhf` does, before anything imports torch
    quiet_library_notices()
    command_name = COMMANDS.get(name, name)
    command = _command(command_name)
    config, given, openrlhf = _given(command, name, options)
    if openrlhf:  # the algorithm chosen by keyword counts as chosen on the command line (no PPO-default note)
        openrlhf = [word for dest in ("algo", "advantage") if dest in given for word in (f"--{dest}", str(given[dest]))
                    ] + openrlhf
    ctx = command.context_class(command, info_name=command_name, obj=CliState(_plugins()), default_map=dict(given),
                                **command.context_settings)
    ctx.meta[API_CALL] = True
    ctx.meta[API_GIVEN] = given
    try:
        with ctx.scope(cleanup=False):
            command.parse_args(ctx, [*(["--config", config] if config else []), *openrlhf])
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
