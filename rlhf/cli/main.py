"""The ``rlhf`` command: a click group whose subcommands live one group per module.

Plugins add commands through ``register_commands(cli)``. Errors caused by the user or by a
plugin are printed as one ``Error:`` line (exit 1; 2 for the command line or the configuration),
without click's ``Usage:`` / ``Try`` banner (``--help`` shows the usage), plus at most one hint
line; ``--verbose`` or ``RLHF_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from rlhf.version import __version__
from rlhf.core.errors import ConfigError, RlhfError, RunInterrupted
from rlhf.cli.state import CliState, debug_enabled
from rlhf.core.plugin_host.loading import PluginSet, build_plugin_manager
from rlhf.runtime.notices import quiet_library_notices

__all__ = ["CliState", "debug_enabled", "main", "make_cli", "quiet_library_notices"]

class RootGroup(click.Group):
    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            show_usage_error(exc)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        # what is left is click.exceptions.Exit's code (--help, --version): a command's own return value
        # (the Python API's result) does not reach here (`invoke` keeps it from the command line)
        sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            super().invoke(ctx)
            return None  # a command's result is for the Python API (rlhf.cli.python_api), not an exit code
        except RlhfError as exc:
            if debug_enabled(ctx):
                raise
            if isinstance(exc, ConfigError):
                raise click.UsageError(str(exc), _subcommand_context(ctx)) from None
            error = click.ClickException(str(exc))
            if isinstance(exc, RunInterrupted):
                error.exit_code = 130  # as a shell reports a Ctrl-C
            raise error from None


def show_usage_error(exc: click.UsageError) -> None:
    """``Error: ...`` and, where the message names no way out, one hint line (the command's ``--help``)."""
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):  # `rlhf` alone: the help, as click shows it
        exc.show()
        return
    click.echo(f"Error: {exc.format_message()}", err=True)
    ctx = exc.ctx
    if ctx is not None and isinstance(exc, click.NoSuchOption) and "did you mean" not in exc.format_message().lower():
        click.echo(f"(`{ctx.command_path} --help` lists the options)", err=True)


def _subcommand_context(ctx: click.Context) -> click.Context:
    """The context of the subcommand that failed, so the usage line and the ``-h`` hint name it
    (``rlhf train``), not the group (whose own context is all that is left once it failed)."""
    name = ctx.invoked_subcommand
    command = ctx.command.get_command(ctx, name) if name and isinstance(ctx.command, click.Group) else None
    return click.Context(command, info_name=name, parent=ctx) if command is not None else ctx


def make_cli(plugins: PluginSet) -> click.Group:
    """A fresh ``rlhf`` group with the built-in commands and the plugins' commands."""
    from rlhf.cli.fit import fit_commands
    from rlhf.cli.generate import datagen_commands
    from rlhf.cli.plot import plot_command
    from rlhf.cli.plugins import plugins_group
    from rlhf.cli.reward import reward_group
    from rlhf.cli.train import train_command
    from rlhf.cli.view import view_command

    @click.group(cls=RootGroup, context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(__version__, "-V", "--version", prog_name="rlhf")
    @click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors, and libraries' notices")
    @click.pass_context
    def cli(ctx: click.Context, verbose: bool) -> None:
        """Plugin-first reinforcement learning for language models.

        \b
        rlhf train ...             train a policy with RL (rlhf train --help)
        rlhf sft / rm / dpo ...    offline training: SFT, reward models, preferences
        rlhf fit --objective NAME  offline training with any objective plugin
        rlhf generate / score      sample and score data: best-of-n, pairs, conditional
        rlhf eval                  a model's eval/* metrics on prompts, as rlhf train reports them
        rlhf iterate / chat        iterative DPO; talk to a model
        rlhf plot RUN ...          a run's curves (reward, KL, length, loss, eval) as a PNG
        rlhf view RUN ...          a local page: curves, samples, tokens; follows a live run
        rlhf plugins list          what is installed, from which package
        rlhf plugins show NAME     one plugin or component in detail
        """
        ctx.obj = CliState(plugins, verbose=verbose)
        if not debug_enabled(ctx):
            quiet_library_notices()

    cli.add_command(plugins_group)
    cli.add_command(plot_command)
    cli.add_command(view_command)
    cli.add_command(reward_group)
    cli.add_command(train_command(plugins))
    for command in datagen_commands(plugins):
        cli.add_command(command)
    for command in fit_commands(plugins, taken=set(cli.commands)):
        cli.add_command(command)
    plugins.add_commands(cli)
    return cli


def main(argv: list[str] | None = None) -> None:
    from rlhf.runtime.run.threads import prepare_openmp

    prepare_openmp()  # before anything imports torch: OpenMP reads it once, when torch loads it
    from rlhf.core.distributed import exit_process, launched_with_ranks

    plugins = build_plugin_manager()
    if not launched_with_ranks():
        make_cli(plugins)(args=argv, prog_name="rlhf")
        return
    try:  # one rank of a launcher: end the process without the interpreter's teardown (exit_process)
        make_cli(plugins)(args=argv, prog_name="rlhf")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_process(code)
