"""Running ``rlhf`` from a plugin's own tests (``rlhf.api.run_rlhf``, what ``rlhf plugins new`` writes)."""

from __future__ import annotations

from typing import Any


def run_rlhf(*args: str) -> Any:
    """``rlhf ARGS`` in this process, with every installed plugin: click's ``Result`` (``exit_code``,
    ``output``); ``run_rlhf("plugins", "check", "my_reward")`` runs the component's contract."""
    from click.testing import CliRunner

    from rlhf.cli.main import make_cli
    from rlhf.core.plugin_host.loading import build_plugin_manager

    return CliRunner().invoke(make_cli(build_plugin_manager()), list(args))
