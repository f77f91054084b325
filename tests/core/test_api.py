"""``rlhf.api``, the plugin API: light to import, every name resolves to its home, the names for
type checkers are the same as those at run time, and docs/plugins.md lists exactly ``__all__``."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf
import rlhf.api as api

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy", "rlhf.fastpaths", "rlhf.objectives", "rlhf.runtime", "rlhf.cli")


def test_importing_the_api_loads_nothing_heavy():
    code = ("import sys, rlhf.api; heavy = " + repr(HEAVY) + "; print(sorted(m for m in sys.modules "
            "if any(m == h or m.startswith(h + '.') for h in heavy)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_every_name_resolves_to_the_object_of_its_home_module():
    assert api.__all__[0] == "API_VERSION" and len(set(api.__all__)) == len(api.__all__)
    for name in api.__all__[1:]:
        module, _, attr = api._HOMES[name].partition(":")
        assert getattr(api, name) is getattr(importlib.import_module(module), attr or name), name
    assert set(api.__all__) <= set(dir(api))


def test_the_hook_marker_is_rlhfs_own():
    assert api.hookimpl is rlhf.hookimpl


def test_the_version_is_major_minor():
    assert isinstance(api.API_VERSION, tuple) and len(api.API_VERSION) == 2
    assert all(isinstance(part, int) for part in api.API_VERSION) and api.API_VERSION >= (1, 0)


def test_a_name_outside_the_api_is_an_attribute_error_that_says_where_to_look():
    with pytest.raises(AttributeError, match=r"no attribute 'RunPlan': the plugin API is rlhf.api.__all__"):
        api.RunPlan  # noqa: B018
    assert not hasattr(api, "masked_mean_of")


def _type_checking_names() -> dict[str, str]:
    """name -> "module" or "module:attr", from the ``if TYPE_CHECKING:`` imports of rlhf/api.py."""
    tree = ast.parse((ROOT / "rlhf" / "api.py").read_text())
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        for alias in node.names:
            names[alias.asname or alias.name] = node.module + (f":{alias.name}" if alias.asname else "")
    return names


def test_type_checkers_see_the_same_names_from_the_same_homes():
    assert _type_checking_names() == api._HOMES


def _documented() -> list[str]:
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text.split("## The plugin API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `(\w+)`", section, flags=re.M)


def test_docs_list_every_name_of_the_api_once_and_nothing_else():
    documented = _documented()
    assert len(documented) == len(set(documented)), "a name is listed twice"
    assert sorted(set(api.__all__) - set(documented)) == [], "names of rlhf.api missing from docs/plugins.md"
    assert sorted(set(documented) - set(api.__all__)) == [], "docs/plugins.md lists names rlhf.api lacks"
