"""What every training command shares: built on first use (`LazyCommand`), ``--config run.yaml``
(`config_file_option`), parsed options turned into a config's values (`config_values`), the checks
that need no torch (`preflight`, model paths included: `check_model_paths`; the run's own checks
before it loads a model: `check_run_out`, `check_reward_labels`), quiet library progress bars, and
what it prints when it ends (`report`: nothing when the Python API called it, `rlhf.cli.python_api`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from rlhf.cli.options import SLOT_SEPARATOR, Flag, config_value_problem, nullable_fields, split_settings


# ctx.meta keys set by the Python API (rlhf.cli.python_api): it called the command (so the command
# returns its result and prints no summary), and the options its caller gave (which a --config file
# does not override, as flags on a command line are not).
API_CALL = "rlhf.api_call"
API_GIVEN = "rlhf.api_given"


def report(text: str) -> None:
    """A command's closing line (``run finished: ...``), left out when the Python API called it."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or not ctx.meta.get(API_CALL):
        click.echo(text)


def preflight(config: Any, plugins: Any = None, before_models: Any = None) -> None:
    """The checks that need no torch, no model and no data: the config's own (ranges, conflicts;
    ``derived`` or ``check``, run again when the run is planned), data files that are not there, the
    components' settings against their declared ranges (``--lora-rank -4``; ``plugins``: the
    command's plugin set), and model options that name no folder and no hub model (``--model
    ./runs/sft/final`` where there is none; `rlhf.core.hub.check_model_path`). Run before the command
    imports the runtime, so a wrong ``--lr`` or model path is said in a moment.

    A run makes other checks before it loads a model (its ``--out``, hub names, the labels its rewards
    need): ``before_models``, the command's torch-free copy of them in the run's order, is called
    before a wrong model path is said, so a command with two mistakes says the one the run would."""
    from rlhf.core.errors import ConfigError

    check = getattr(config, "derived", None) or getattr(config, "check", None)
    if check is not None:
        check()
    for flag in ("data", "eval_data"):
        refs = getattr(config, flag, None)
        for ref in [refs] if isinstance(refs, str) else (refs or ()):
            path = Path(str(ref)).expanduser()
            if path.suffix in DATA_FILE_SUFFIXES and not path.exists():
                raise ConfigError(f"--{flag.replace('_', '-')} {ref}: data file {str(ref)!r} does not exist")
    if plugins is not None and hasattr(config, "check_setting_ranges"):
        config.check_setting_ranges(plugins)
    check_model_paths(config, before_models)


MODEL_OPTIONS = ("critic_model", "teacher", "model", "tokenizer")  # in the order a run checks them


def check_model_paths(config: Any, before_models: Any = None) -> None:
    """The first of ``config``'s model options that names no folder here and cannot be a hub name, as
    one `ConfigError`, after ``before_models`` (see `preflight`); nothing when all may be models."""
    from rlhf.core.errors import ConfigError
    from rlhf.core.hub import check_model_path

    problems: list[ConfigError] = []
    for name in MODEL_OPTIONS:
        ref = getattr(config, name, None)
        try:
            if ref:
                check_model_path(str(ref), f"--{name.replace('_', '-')}")
        except ConfigError as exc:
            problems.append(exc)
    if problems:
        if before_models is not None:
            before_models()
        raise problems[0]


def check_run_out(out: Any, layout: Any) -> None:
    """A run's ``--out`` as the run checks it before anything is built (`before_models`): not a folder
    of other files (``layout``: the kind of run), not in use by another run, writable (its lock taken
    and let go at once). The main rank only, as the run itself."""
    import os

    from rlhf.runtime.run.run_files import check_not_foreign
    from rlhf.runtime.run.run_lock import LOCK_NAME, RunLock

    if not out or os.environ.get("RANK", "0") != "0":
        return
    if not (Path(out) / LOCK_NAME).exists():
        check_not_foreign(Path(out), layout)
    with RunLock.for_directory(out):
        pass


def check_reward_labels(config: Any, plugins: Any) -> None:
    """The ``--reward`` sources load (a typo, a missing file) and get the labels they compare with
    (``--label-key``), as the run checks them before it loads a model (`before_models`)."""
    import dataclasses

    from rlhf.rewards import load_rewards

    if not getattr(config, "reward", None):
        return
    options = dataclasses.asdict(config.reward_options)
    rewards = load_rewards(config.reward, plugins=plugins, on_error=options.pop("on_error"), **options)
    rewards.check_labels_given(config.label_key)


DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")  # a name with one of these is a file (runtime/run/data.py)


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


def config_file_option(flags: list[Flag], config_cls: Any, fixed: dict[str, Any] | None = None) -> Any:
    """``--config run.yaml``: the file's values become click's defaults, so explicit flags win.

    Keys are the flags' names (``_`` or ``-``); component settings may be ``components: {slot:
    {...}}``, dotted keys (``backend.zero_stage``) or a setting's short flag (``zero_stage``, when
    the command has ``--zero-stage``). Nested groups may be mappings. ``fixed``: values the command
    itself sets (``rlhf sft`` sets ``objective: sft``), so a run's own config.yaml is accepted by its
    command; a file that sets one to another value is refused."""
    aliases = {flag.dest.partition(SLOT_SEPARATOR)[2]: flag.dest.partition(SLOT_SEPARATOR)[0] for flag in flags
               if SLOT_SEPARATOR in flag.dest and len(flag.names) > 1}

    def load(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        from rlhf.core.errors import ConfigError
        from rlhf.core.inputs.safe_yaml import load_yaml
        from rlhf.runtime.config.options import gather_components

        try:
            loaded = load_yaml(Path(value).read_text(), value) or {}
        except OSError as exc:
            raise click.BadParameter(f"cannot read {value}: {exc.strerror or exc}", ctx, param) from None
        except ConfigError as exc:  # not YAML, nested aliases, a python tag: one line
            raise click.BadParameter(f"cannot read {exc}", ctx, param) from None
        if not isinstance(loaded, dict):
            raise click.BadParameter(f"{value} must hold a mapping of option names to values", ctx, param)
        mapping = {str(key).replace("-", "_"): item for key, item in loaded.items()}
        for key in [k for k in mapping if k in config_cls.NESTED and isinstance(mapping[k], dict)]:
            prefix = config_cls.NESTED[key][0]
            mapping.update({f"{prefix}_{str(k).replace('-', '_')}": v for k, v in mapping.pop(key).items()})
        try:
            components = gather_components(mapping, config_cls.setting_slots(), aliases)
        except ConfigError as exc:
            raise click.BadParameter(f"{value}: {exc}", ctx, param) from None
        for slot, settings in components.items():
            mapping.update({f"{slot}{SLOT_SEPARATOR}{name}": item for name, item in settings.items()})
        for key, own in (fixed or {}).items():
            if key in mapping and mapping.pop(key) != own:
                raise click.BadParameter(f"{value} sets {key} {loaded.get(key)!r}, and this command is for "
                                         f"{key} {own!r}: run `rlhf {loaded.get(key)} --config {value}`", ctx, param)
        names = {flag.dest for flag in flags}
        unknown = sorted(set(mapping) - names)
        if unknown:
            from rlhf.core.errors import close_matches

            shown = [u.replace(SLOT_SEPARATOR, ".") for u in unknown]
            hint = close_matches(shown[0], sorted(n.replace(SLOT_SEPARATOR, ".") for n in names), n=1)
            raise click.BadParameter(f"{value}: unknown option(s) {', '.join(shown)}"
                                     + (f"; did you mean {hint[0]}?" if hint else ""), ctx, param)
        for flag in flags:
            if flag.dest not in mapping:
                continue
            problem = config_value_problem(flag, mapping[flag.dest])
            if problem is not None:
                shown = repr(mapping[flag.dest])
                raise click.BadParameter(f"{value}: {flag.dest.replace(SLOT_SEPARATOR, '.')} must be {problem}, not "
                                         f"{shown if len(shown) <= 60 else shown[:57] + '...'}", ctx, param)
            if flag.multiple and isinstance(mapping.get(flag.dest), (str, int, float)):
                mapping[flag.dest] = [mapping[flag.dest]]
        ctx.default_map = {**(ctx.default_map or {}), **mapping, **ctx.meta.get(API_GIVEN, {})}
        return value

    return click.option("--config", "config_file", type=click.Path(dir_okay=False), callback=load, is_eager=True,
                        expose_value=True, help="YAML file with option values (flags override it)")


def config_values(kwargs: dict[str, Any], config_cls: type) -> dict[str, Any]:
    """Parsed options -> the values of ``config_cls.from_dict``: component settings gathered into
    ``components``, unset options left out (except those that may be None)."""
    from rlhf.cli.params import Named

    kwargs = dict(kwargs)
    kwargs.pop("config_file", None)
    components = split_settings(kwargs)
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
    values = {k: (v.ref if isinstance(v, Named) else v) for k, v in values.items()}  # components: keep names
    values = {k: v for k, v in values.items() if v is not None or k in nullable_fields(config_cls)}
    return {**values, "components": components}


FORMAT_OPTIONS = ("apply_chat_template", "input_template")


def model_prompt_format(values: dict[str, Any], model: str | None) -> None:
    """Where the user gave neither ``--apply-chat-template`` nor ``--input-template`` (on the command
    line or in a ``--config`` file), format prompts as ``model`` was trained (its
    ``prompt_format.json``, rlhf/runtime/run/prompt_format.py), and say so once (main rank)."""
    import os

    from click.core import ParameterSource

    from rlhf.runtime.run.prompt_format import PromptFormat

    ctx = click.get_current_context()
    if any(ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT) for name in FORMAT_OPTIONS):
        return
    recorded = PromptFormat.read(model)
    if recorded is None:
        return
    values.update(apply_chat_template=recorded.apply_chat_template, input_template=recorded.input_template)
    if os.environ.get("RANK", "0") == "0":
        click.echo(f"prompts are formatted with {recorded.describe()}, as {model} was trained (its "
                   "prompt_format.json; --apply-chat-template or --input-template to change)", err=True)


def quiet_library_progress_bars() -> None:
    """transformers and datasets draw their own bars (weights loading, splits); ours is the one that counts."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
