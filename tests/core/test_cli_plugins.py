"""``rlhf plugins list`` and ``rlhf plugins show``, in-process and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

import rlhf
from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import run_cli

pytestmark = pytest.mark.unit

SAMPLE = "tests.core.sample_plugin"
JSON_KEYS = {"name", "distribution", "version", "source", "status", "hooks", "provides", "aliases", "error",
             "warnings"}


@pytest.fixture
def with_builtin():
    """A plugin set whose only built-in is the sample plugin (a stand-in for rlhf's own)."""
    return build_plugin_manager(load_entrypoints=False, builtins=[SAMPLE])


def test_list_without_third_party_plugins_says_so(with_builtin):
    result = run_cli(with_builtin, ["plugins", "list"])
    assert result.exit_code == 0
    assert result.output == "No plugins installed. Use --all to include built-ins.\n"


def test_list_all_shows_builtins_with_kind_package_version_description(with_builtin):
    result = run_cli(with_builtin, ["plugins", "list", "--all"])
    assert result.exit_code == 0
    header, row = result.output.splitlines()[:2]
    assert header.split() == ["KIND", "NAME", "PACKAGE", "VERSION", "DESCRIPTION"]
    assert row.split()[:4] == ["reward", "length", "rlhf-core", rlhf.__version__]
    assert "Length of each completion, in characters." in row


def test_list_json_schema(with_builtin, make_plugin):
    with_builtin.register(make_plugin("inline_logger", on_step_end=lambda metrics: None),
                          distribution="rlhf-log", version="1.2")
    result = run_cli(with_builtin, ["plugins", "list", "--all", "--json"])
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == [SAMPLE, "inline_logger"]
    for row in rows:
        assert set(row) == JSON_KEYS
        assert isinstance(row["hooks"], list) and isinstance(row["provides"], dict)
        assert all(isinstance(v, list) for v in row["provides"].values())
    builtin, logger = rows
    assert builtin == {
        "name": SAMPLE, "distribution": "rlhf-core", "version": rlhf.__version__, "source": "builtin",
        "status": "ok", "hooks": ["register_rewards"], "provides": {"reward": ["length"]}, "aliases": {},
        "error": None, "warnings": [],
    }
    assert logger["hooks"] == ["on_step_end"] and logger["provides"] == {} and logger["source"] == "inline"


def test_list_without_all_hides_builtins_in_json(with_builtin):
    assert json.loads(run_cli(with_builtin, ["plugins", "list", "--json"]).output) == []


def test_list_shows_lifecycle_only_plugins_as_hooks(with_builtin, make_plugin):
    with_builtin.register(make_plugin("csv_logger", on_step_end=lambda metrics: None, on_run_end=lambda status: None),
                          distribution="rlhf-csv", version="0.1")
    output = run_cli(with_builtin, ["plugins", "list"]).output
    assert "hooks" in output and "csv_logger" in output and "on_run_end, on_step_end" in output


def test_list_kind_filter(with_builtin, make_plugin):
    with_builtin.register(make_plugin("kl_pack", register_kl_estimators=lambda register: register("kx", abs)))
    output = run_cli(with_builtin, ["plugins", "list", "--all", "--kind", "kl_estimator"]).output
    assert "kx" in output and "length" not in output


def test_show_component_prints_provider_flags_and_config(make_plugin, plugins):
    @dataclass(kw_only=True)
    class HelloConfig:
        greeting: str = field(default="hello", metadata={"help": "The word to look for"})

    def says(completions):
        """Scores greetings."""

    plugins.register(make_plugin("greetings", register_rewards=lambda register: register(
        "says", says, config_cls=HelloConfig, batched=True)), distribution="rlhf-greet", version="0.4")
    output = run_cli(plugins, ["plugins", "show", "says"]).output
    assert "reward says" in output
    assert "provided by: rlhf-greet 0.4 (greetings)" in output
    assert "selected by: --reward says" in output
    assert "batched=True" in output
    assert "greeting (str, default 'hello'): The word to look for" in output


def test_show_broken_plugin_prints_the_traceback(fake_site):
    fake_site.add("rlhf-oops", "0.1", {"oops": "rlhf_oops_mod"}, {"rlhf_oops_mod": "1 / 0\n"})
    output = run_cli(build_plugin_manager(), ["plugins", "show", "oops"]).output
    assert "status:   error" in output and "ZeroDivisionError" in output and "Traceback" in output


def test_show_unknown_name_is_a_usage_error_with_a_suggestion(with_builtin):
    result = run_cli(with_builtin, ["plugins", "show", "lenght"])
    assert result.exit_code == 2
    assert "no plugin or component called 'lenght'; did you mean 'length'?" in result.output
    unrelated = run_cli(with_builtin, ["plugins", "show", "nosuch"])  # shares three letters with 'torch'
    assert unrelated.exit_code == 2
    assert "no plugin or component called 'nosuch'. See `rlhf plugins list --all`." in unrelated.output


def test_version_and_short_help(plugins):
    assert run_cli(plugins, ["--version"]).output == f"rlhf, version {rlhf.__version__}\n"
    assert "Inspect installed plugins" in run_cli(plugins, ["-h"]).output


def test_real_command_lists_a_fake_dist_as_json(fake_site):
    fake_site.add("rlhf-subproc", "3.2.1", {"subproc": "rlhf_subproc_mod"}, {"rlhf_subproc_mod": """
        import rlhf

        @rlhf.hookimpl
        def register_kl_estimators(register):
            register("k_sub", "math:fabs", description="Absolute value")
    """})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake_site.root), *sys.path])}
    result = subprocess.run([sys.executable, "-m", "rlhf", "plugins", "list", "--json"],
                            capture_output=True, text=True, env=env, check=True)
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["subproc"]["version"] == "3.2.1"
    assert rows["subproc"]["provides"] == {"kl_estimator": ["k_sub"]}
