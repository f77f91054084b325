"""``rlhf plugins new``: what it writes, and what it refuses."""

from __future__ import annotations

import ast

import pytest

from rlhf.plugin_kit.scaffold import SPECS
from tests.helpers import run_cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_new_writes_a_package_with_entry_point_light_plugin_module_test_and_readme(plugins, tmp_path, kind):
    result = run_cli(plugins, ["plugins", "new", kind, "my-thing", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    root = tmp_path / "rlhf-my-thing"
    impl = SPECS[kind].impl
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == sorted(["README.md", "pyproject.toml", "rlhf_my_thing/__init__.py", "rlhf_my_thing/plugin.py",
                            f"rlhf_my_thing/{impl}.py", "tests/test_my_thing.py"])
    assert '[project.entry-points.rlhf]\nmy_thing = "rlhf_my_thing.plugin"' in (root / "pyproject.toml").read_text()
    assert 'name = "rlhf-my-thing"' in (root / "pyproject.toml").read_text()
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "__" + "NAME" not in text and "__MODULE__" not in text, path
        ast.parse(text)
    plugin = ast.parse((root / "rlhf_my_thing" / "plugin.py").read_text())
    imported = {alias.name for node in ast.walk(plugin) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(plugin) if isinstance(node, ast.ImportFrom)}
    assert imported == {"rlhf.api"}, "the plugin module must stay light"
    assert f'"rlhf_my_thing.{impl}:' in (root / "rlhf_my_thing" / "plugin.py").read_text()
    assert "rlhf plugins check my_thing" in (root / "README.md").read_text()
    assert f"pip install -e {root}" in result.output


def test_new_refuses_an_existing_folder_and_writes_nothing(plugins, tmp_path):
    (tmp_path / "rlhf-taken").mkdir()
    result = run_cli(plugins, ["plugins", "new", "reward", "taken", "--dir", str(tmp_path)])
    assert result.exit_code == 2 and "already exists" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rlhf-taken"]


def test_new_warns_when_an_installed_plugin_has_the_name_already(plugins, tmp_path):
    """Both would be reported and neither used once the package is installed: say so while it is a scaffold."""
    result = run_cli(plugins, ["plugins", "new", "reward", "exact_match", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "Warning: rlhf-core" in result.output and "already provides a reward called 'exact_match'" in result.output
    assert "RLHF_DISABLE_PLUGINS" in result.output
    fresh = run_cli(plugins, ["plugins", "new", "reward", "my_own_score", "--dir", str(tmp_path)])
    assert fresh.exit_code == 0 and "Warning" not in fresh.output


def test_new_refuses_an_unknown_kind_listing_the_kinds(plugins, tmp_path):
    result = run_cli(plugins, ["plugins", "new", "rewards", "x", "--dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "no template for kind 'rewards'; kinds: advantage_estimator," in result.output
    assert list(tmp_path.iterdir()) == []


def test_new_refuses_a_name_that_is_not_an_identifier(plugins, tmp_path):
    result = run_cli(plugins, ["plugins", "new", "reward", "3rd:party", "--dir", str(tmp_path)])
    assert result.exit_code == 2 and "must be a Python identifier" in result.output


def test_every_kind_has_a_template():
    from rlhf.core.plugin_host.kinds import KINDS

    assert sorted(SPECS) == sorted(KINDS), "add a KindTemplate to rlhf.plugin_kit.scaffold.SPECS and its template"
