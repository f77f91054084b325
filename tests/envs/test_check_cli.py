"""``rlhf plugins check NAME`` through the real command line (CliRunner)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.helpers import run_cli

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tir runs the sandbox")
def test_check_tir_plays_a_scripted_episode(plugins):
    result = run_cli(plugins, ["plugins", "check", "tir"])
    assert result.exit_code == 0, result.output
    assert "step 1: 'Let me compute it.\\n```python\\nprint(6 * 7)\\n```\\n' -> observation '```output\\n42\\n```\\n'" in result.output
    assert "episode ended after 2 turn(s)" in result.output
    assert result.output.rstrip().endswith("ok: the contract holds")


def test_check_single_turn(plugins):
    result = run_cli(plugins, ["plugins", "check", "single-turn"])
    assert result.exit_code == 0, result.output
    assert "episode ended after 1 turn(s)" in result.output


def test_check_a_broken_env_given_by_reference_exits_1(plugins, tmp_path):
    path = tmp_path / "bad_env.py"
    path.write_text(textwrap.dedent("""
        class BadEnv:
            def reset(self, prompt, label):
                return None

            def step(self, action_text):
                return "oops"
    """))
    result = run_cli(plugins, ["plugins", "check", f"{path}:BadEnv"])
    assert result.exit_code == 1
    assert "env" in result.output and "breaks the environment contract" in result.output
    assert "BadEnv.step must return rlhf.core.types.StepResult, got str" in result.output


def test_other_kinds_are_checked_too(plugins, make_plugin):
    # every kind has a check now (tests/plugin_kit); `len` takes nothing a run passes to a reward
    plugins.register(make_plugin("check_probe", register_rewards=lambda register: register("probe_reward", len)))
    result = run_cli(plugins, ["plugins", "check", "probe_reward"])
    assert result.exit_code == 1, result.output
    assert "Error: reward 'probe_reward': declares parameter(s) obj that a run does not pass" in result.output


def test_unknown_name_is_a_usage_error(plugins):
    result = run_cli(plugins, ["plugins", "check", "no_such_env"])
    assert result.exit_code == 2 and "no component called 'no_such_env'" in result.output
