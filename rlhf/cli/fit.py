"""``rlhf fit --objective NAME`` and one command per objective registered with ``command=True``
(``rlhf sft``, ``rlhf rm``, ``rlhf dpo``, ``rlhf kto``, ``rlhf prm``, ``rlhf distill``).

Flags come from `rlhf.runtime.config.fit_config.FitConfig` (one per field) and the components'
settings: ``--backend.zero-stage`` and the model adapter's (with their short aliases, as in
``rlhf train``), and the objective's, ``--objective.<setting>``. A dedicated command fixes the
objective and gives its settings plain flags too (``rlhf dpo --beta 0.1``). A setting that holds
a list takes one value or several (``--reward-tokens + -``).
"""

from __future__ import annotations

import typing
from typing import Any

import click

from rlhf.cli.commands import (LazyCommand, config_file_option, config_values, model_prompt_format, preflight,
                               quiet_library_progress_bars, report)
from rlhf.cli.options import SLOT_SEPARATOR, Flag, component_flags, config_flags, setting_flags

FIT_HELP = "Train a model offline with any objective plugin (rlhf plugins list --kind objective)."
_GROUP_TITLES = {"objective": "Objective", "model": "Model", "data": "Data", "train": "Optimisation",
                 "runtime": "Runtime", "eval": "Eval", "output": "Output"}


def fit_flags(plugins: Any, objective: Any = None) -> list[Flag]:
    """The flags of ``rlhf fit`` (``objective`` None) or of one objective's command."""
    from rlhf.runtime.config.fit_config import FIT_SLOTS, FitConfig
    from rlhf.runtime.config.options import MODEL_SLOTS

    skip = ("components",) + (("objective",) if objective is not None else ())
    flags = config_flags(FitConfig, titles=_GROUP_TITLES, skip=skip) + component_flags(
        plugins, MODEL_SLOTS, FitConfig.short_flags(plugins))
    if objective is None:
        return flags + component_flags(plugins, {"objective": FIT_SLOTS["objective"]}, {})
    taken = {name for flag in flags for name in flag.names}
    own = setting_flags(FIT_SLOTS["objective"], objective.name, objective.load_config_cls(), plain=True)
    return flags + [Flag(**{**vars(flag), "names": tuple(n for n in flag.names if n not in taken)}) for flag in own]


class VariadicCommand(click.Command):
    """A command whose list settings take several values after one flag: ``--reward-tokens + -``
    is ``--reward-tokens + --reward-tokens -`` (values run until the next ``--flag``)."""

    variadic: frozenset[str] = frozenset()

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        current: str | None = None
        for arg in args:
            if arg == "--":
                current = None
            elif arg.startswith("--"):
                current = arg if arg in self.variadic else None
                out.append(arg)
                continue
            elif current is not None and out and out[-1] != current:
                out.append(current)
            out.append(arg)
        return super().parse_args(ctx, out)


def build_fit_command(plugins: Any, objective: Any = None) -> click.Command:
    flags = fit_flags(plugins, objective)
    name = "fit" if objective is None else objective.name

    def command(**kwargs: Any) -> Any:
        from rlhf.cli.state import CliState
        from rlhf.runtime.config.fit_config import FitConfig

        values = config_values(kwargs, FitConfig)
        if objective is not None:
            values["objective"] = objective.name
        if not values.get("objective"):
            raise click.UsageError("--objective is required (see `rlhf plugins list --kind objective`)")
        if not values.get("model"):
            raise click.UsageError("--model is required (a local HF model directory or a hub name)")
        model_prompt_format(values, values["model"])
        if not values.get("data"):
            raise click.UsageError("--data is required (a dataset file, folder or hub name)")
        state = click.get_current_context().find_object(CliState)
        config = FitConfig.from_dict(values, state.plugins)
        preflight(config, state.plugins, lambda: before_models(config))  # before torch loads
        quiet_library_progress_bars()
        from rlhf.runtime.fit.local import fit
        from rlhf.cli.run_result import RunResult

        out = fit(config, plugins=state.plugins)
        report(f"run finished: {out}")
        return RunResult.of(out)

    command.__doc__ = _help(objective)
    from rlhf.runtime.config.fit_config import FitConfig

    for flag in reversed(flags):
        command = flag.option()(command)
    command = config_file_option(flags, FitConfig, fixed={"objective": objective.name} if objective else None)(command)
    from rlhf.cli.openrlhf_names import OpenRLHFNames

    cls = type("FitCommand", (OpenRLHFNames, VariadicCommand), {"variadic": frozenset(
        n for flag in flags if flag.multiple and SLOT_SEPARATOR in flag.dest and _is_list(flag.hint)
        for n in flag.names)})
    short_help = FIT_HELP if objective is None else objective.description
    return click.command(name, cls=cls, short_help=short_help, context_settings={"max_content_width": 120})(command)


def before_models(config: Any) -> None:
    """What an offline run checks before it loads a model, in its order, without torch (`preflight`
    calls it before it says that a model path is wrong): ``--teacher`` (here whatever the objective)
    and the ``--out`` folder."""
    from rlhf.cli.commands import check_run_out
    from rlhf.core.hub import check_model_option
    from rlhf.runtime.run.run_files import TRAINING

    if config.teacher:
        check_model_option(config.teacher, "--teacher")
    check_run_out(config.out, TRAINING)


def _is_list(hint: Any) -> bool:
    return any(typing.get_origin(arg) is list for arg in (hint, *typing.get_args(hint)))


def _help(objective: Any) -> str:
    if objective is None:
        return """Train a model offline with an objective plugin (this process, or torchrun ranks).

        \b
        rlhf fit --objective NAME --model runs/sft/final --data data.jsonl --out runs/NAME
        rlhf fit --objective my_pkg.objectives:SimPO --model ... --data ...
        python -m torch.distributed.run --standalone --nproc-per-node 2 -m rlhf fit ...

        The objective's own options are --objective.<option> (`rlhf plugins show NAME` lists
        them). Every option can also come from --config run.yaml (flags override the file).
        """
    example = (objective.capabilities.get("example")  # registered with the objective (register(..., example=))
               or f"rlhf {objective.name} --model ... --data ... --out runs/{objective.name}")
    return f"""{objective.description} (the {objective.name!r} objective of `rlhf fit`).

        \b
        {example}
        python -m torch.distributed.run --standalone --nproc-per-node 2 -m rlhf {objective.name} ...

        The objective's options also answer to --objective.<option>. Every option can also come
        from --config run.yaml (flags override the file). See docs/objectives.md.
        """


def fit_commands(plugins: Any, taken: set[str]) -> list[click.Command]:
    """``rlhf fit``, and a command for each objective registered with ``command=True`` whose name is
    free (a clashing one stays reachable as ``rlhf fit --objective NAME``)."""
    commands: list[click.Command] = [LazyCommand("fit", FIT_HELP, lambda: build_fit_command(plugins))]
    names = set(taken) | {"fit"}
    for component in plugins.registry("objective").components():
        if not component.capabilities.get("command") or component.name in names:
            continue
        names.add(component.name)
        commands.append(LazyCommand(component.name, component.description or f"Train with {component.name}.",
                                    lambda c=component: build_fit_command(plugins, c)))
    return commands
