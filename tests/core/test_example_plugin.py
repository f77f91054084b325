"""Real pip installs of third-party plugin packages: the shipped example and the one the README
teaches. Both go into a temporary --target folder, so the test environment is left untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import pip_install, readme_plugin_files

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def rlhf_cli(target: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *sys.path])}
    return subprocess.run([sys.executable, "-m", "rlhf", *args], capture_output=True, text=True, env=env, check=True)


def test_pip_installed_example_plugin_is_listed_with_version_and_component(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ROOT / "examples" / "plugins" / "rlhf-hello", source)  # builds write next to the source
    pip_install(source, tmp_path / "site")

    rows = {r["name"]: r for r in json.loads(rlhf_cli(tmp_path / "site", "plugins", "list", "--json").stdout)}
    hello = rows["hello"]
    assert (hello["distribution"], hello["version"], hello["status"]) == ("rlhf-hello", "0.1.0", "ok")
    assert hello["provides"] == {"reward": ["says_hello"]}

    shown = rlhf_cli(tmp_path / "site", "plugins", "show", "says_hello").stdout
    assert "provided by: rlhf-hello 0.1.0 (hello)" in shown
    assert "object:      rlhf_hello.plugin:says_hello" in shown


def test_the_readme_plugin_example_installs_and_shows_up(tmp_path):
    files = readme_plugin_files()
    assert "pyproject.toml" in files and len(files) >= 2, f"README example files not found: {sorted(files)}"
    package = tmp_path / "readme-plugin"
    for relative, text in files.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text)
    pip_install(package, tmp_path / "site")

    installed = {p.name for p in (tmp_path / "site").glob("*.dist-info")}
    assert len(installed) == 1, installed
    dist = installed.pop().split("-")[0].replace("_", "-")
    rows = [r for r in json.loads(rlhf_cli(tmp_path / "site", "plugins", "list", "--json").stdout)
            if r["distribution"] == dist]
    assert len(rows) == 1 and rows[0]["status"] == "ok", rows
    assert rows[0]["provides"], "the README plugin provides nothing"
