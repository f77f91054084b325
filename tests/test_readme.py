"""The README's two set-up commands are what a newcomer runs, and its tiers are the tests'; keep them true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _command_after(heading: str) -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"## {heading}", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim():
    command = _command_after("Run the tests")
    assert command.startswith("python3 -m venv .venv") and "pip install torch==2.13.0" in command
    assert re.search(r"&& pytest( -\S+( \w+)?)*$", command), "the command ends by running pytest"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, ".ci/run must run the README's test command verbatim"


def test_quickstart_pins_cpu_torch_before_installing_rlhf():
    command = _command_after("Quickstart")
    assert command.index("pip install torch==2.13.0") < command.index("pip install -e .")


def test_the_readme_lists_the_tiers_the_tests_are_marked_with():
    from tests.conftest import TIERS

    section = (ROOT / "README.md").read_text().split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| `([^`]+)` \| [^|]+ \|$", section, re.M)
    assert [name for name, _ in rows] == list(TIERS)
    for name, command in rows:
        assert command.startswith("pytest ") and command.endswith(f"-m {name}"), command
    markers = (ROOT / "pyproject.toml").read_text()
    assert all(f'"{name}: ' in markers for name in TIERS), "register each tier in pyproject.toml's markers"
