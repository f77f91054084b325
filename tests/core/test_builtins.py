"""Built-in plugins prove the plugin API is enough: they import rlhf only through ``rlhf.api`` (and
``rlhf.sandbox``) besides their own plugin package, they load cleanly, and importing them stays cheap."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.core.plugin_host.loading import DEFAULT_PLUGINS, build_plugin_manager

pytestmark = pytest.mark.unit

PLUGINS_DIR = Path(__file__).resolve().parents[2] / "rlhf" / "plugins"
PLUGIN_FILES = sorted(PLUGINS_DIR.rglob("*.py"))


def _rlhf_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n == "rlhf" or n.startswith("rlhf.")]


@pytest.mark.parametrize("path", PLUGIN_FILES, ids=lambda p: str(p.relative_to(PLUGINS_DIR)))
def test_builtin_plugins_import_only_the_public_api(path):
    package = ".".join(("rlhf", "plugins", *path.relative_to(PLUGINS_DIR).parts[:1]))
    for name in _rlhf_imports(path):
        allowed = any(name == a or name.startswith(a + ".") for a in ("rlhf.api", "rlhf.sandbox", package))
        assert allowed, f"{path.name} imports {name}; built-ins may use rlhf.api, rlhf.sandbox and {package} only"


def test_builtin_plugins_load_without_errors_or_warnings():
    plugins = build_plugin_manager(load_entrypoints=False)
    plugins.registries()
    records = [r for r in plugins.records if r.source == "builtin"]
    assert [r.name for r in records] == list(DEFAULT_PLUGINS)
    for record in records:
        assert (record.status, record.error, record.warnings) == ("ok", None, []), record.label


def test_builtin_plugin_modules_import_no_torch():
    code = (
        "import json, sys, importlib\n"
        f"for m in {list(DEFAULT_PLUGINS)!r}: importlib.import_module(m)\n"
        "print(json.dumps([m for m in ('torch', 'transformers', 'datasets', 'peft') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
