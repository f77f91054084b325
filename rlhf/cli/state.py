"""What every command can reach through ``@click.pass_obj``, and whether errors show tracebacks."""

from __future__ import annotations

import os

import click

from rlhf.core.plugin_host.loading import PluginSet


class CliState:
    """The plugin set the command line was built with, and ``--verbose``."""

    def __init__(self, plugins: PluginSet, verbose: bool = False):
        self.plugins = plugins
        self.verbose = verbose


def debug_enabled(ctx: click.Context | None = None) -> bool:
    if os.environ.get("RLHF_DEBUG", "") not in ("", "0"):
        return True
    state = ctx.find_object(CliState) if ctx is not None else None
    return bool(state and state.verbose)
