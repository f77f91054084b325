"""docs/from-trl.md cannot drift: every rlhf flag its tables name, and every flag of its ``rlhf ...``
command lines, is an option of the command the section (or the line) names."""

from __future__ import annotations

import re

import click
import pytest

from rlhf.cli.main import make_cli
from tests.helpers import ROOT

pytestmark = pytest.mark.unit

PAGE = ROOT / "docs" / "from-trl.md"
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9.-]*")


def _options(cli: click.Group, name: str) -> set[str]:
    command = cli.get_command(click.Context(cli), name)
    command = getattr(command, "command", command)
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def claims() -> list[tuple[str, str, str]]:
    """``(command, flag, line)``: flags in the tables' rlhf column and on ``rlhf CMD`` lines."""
    found = []
    for section in re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        titled = re.findall(r"`rlhf (\w+)`", title)
        for line in body.splitlines():
            if line.startswith("rlhf "):
                found += [(line.split()[1], flag, line) for flag in _FLAG.findall(line)]
            elif line.startswith("| ") and not line.startswith("| TRL") and titled:
                cells = line.split(" | ")
                if len(cells) >= 2:
                    found += [(titled[0], flag, line) for flag in _FLAG.findall(cells[1])]
    return found


def test_the_page_names_only_real_options(plugins):
    cli = make_cli(plugins)
    found = claims()
    assert len(found) > 60
    missing = [(command, flag) for command, flag, _ in found if flag not in _options(cli, command)]
    assert missing == []


def test_the_python_example_uses_the_apis_keywords():
    from rlhf.cli.python_api import _command, option_names

    text = PAGE.read_text()
    call = text[text.index("train(algo="):text.index('out="runs/grpo")')]
    keywords = re.findall(r"(\w+)=", call)
    names = option_names(_command("train"))
    assert keywords and [k for k in keywords if k not in names] == []
