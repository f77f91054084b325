"""Every built-in component passes its own contract check, every kind has a check, and the check
reports the plugin's import time (warning when it is slow)."""

from __future__ import annotations

import pytest

from rlhf.core.plugin_host.kinds import KINDS
from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.plugin_kit.checks import CHECKS, check_for
from tests.helpers import run_cli

RUN_KINDS = {"model", "rollout_engine", "train_backend"}  # their checks train or generate with a tiny model


def _builtin_names() -> list[tuple[str, bool]]:
    plugins = build_plugin_manager(load_entrypoints=False)
    names: dict[str, bool] = {}
    for registry in plugins.registries().values():
        for component in registry.components():
            names[component.name] = names.get(component.name, False) or registry.kind.name in RUN_KINDS
    return sorted(names.items())


NAMES = _builtin_names()


@pytest.mark.unit
def test_every_kind_has_a_contract_check():
    assert sorted(CHECKS) == sorted(KINDS), "add rlhf/plugin_kit/checks/<kind>.py and its line in CHECKS"
    for kind in KINDS:
        assert callable(check_for(kind))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.run if runs else pytest.mark.unit)
                                  for n, runs in NAMES])
def test_every_builtin_component_passes_its_check(plugins, name):
    result = run_cli(plugins, ["plugins", "check", name])
    assert result.exit_code == 0, result.output
    blocks = result.output.count(" (from rlhf-core ")
    assert blocks >= 1 and result.output.count("ok: the contract holds") + result.output.count("skipped: it needs a GPU") == blocks


@pytest.mark.unit
def test_the_import_time_is_reported_and_a_slow_plugin_warned(plugins, fake_site):
    fake_site.add("rlhf-fast", "1.0", {"fast": "fast_plugin"}, {"fast_plugin": """
        import rlhf

        def fast_reward(completions):
            return [0.0] * len(completions)

        @rlhf.hookimpl
        def register_rewards(register):
            register("fast_reward", fast_reward)
    """})
    fake_site.add("rlhf-slow", "1.0", {"slow": "slow_plugin"}, {"slow_plugin": """
        import time
        import rlhf
        time.sleep(0.3)  # stands for `import torch` at the top of the plugin module

        def slow_reward(completions):
            return [0.0] * len(completions)

        @rlhf.hookimpl
        def register_rewards(register):
            register("slow_reward", slow_reward)
    """})
    from tests.helpers import run_cli as run
    plugins = build_plugin_manager()
    fast = run(plugins, ["plugins", "check", "fast_reward"])
    assert fast.exit_code == 0, fast.output
    assert "import time of plugin module fast_plugin: " in fast.output and "warning" not in fast.output
    slow = run(plugins, ["plugins", "check", "slow_reward"])
    assert slow.exit_code == 0, slow.output
    assert "warning: import time of plugin module slow_plugin: " in slow.output
    assert "over 100 ms" in slow.output and 'register the object as a "module:attr" string' in slow.output


@pytest.mark.unit
def test_a_plugin_that_imports_torch_is_named_as_the_cause(fake_site):
    fake_site.add("rlhf-torchy", "1.0", {"torchy": "torchy_plugin"}, {"torchy_plugin": """
        import torch
        import rlhf

        def torchy(completions):
            return [0.0] * len(completions)

        @rlhf.hookimpl
        def register_rewards(register):
            register("torchy", torchy)
    """})
    from rlhf.plugin_kit.check import import_time

    plugins = build_plugin_manager()
    timing = import_time(plugins.record("torchy"))
    assert timing is not None and "torch" in timing.heavy
    assert "torch" in timing.describe() or not timing.slow
