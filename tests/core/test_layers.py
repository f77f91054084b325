"""The layers of docs/architecture.md, machine-checked: ``cli -> runtime -> core <- plugins``.

* no import circle between rlhf's modules, counting every import: inside functions and under
  ``if TYPE_CHECKING:`` too (a type that only annotations need still belongs below its users);
* no package of rlhf holds more than 15 modules side by side (a package splits by concept into
  sub-packages before a reader has to search it);
* the host (core, runtime, cli, algorithms, rewards) never imports a plugin module: it reaches
  plugins only through registries;
* every built-in plugin module, and every object a built-in registers (lazy ``"module:attr"``
  targets and config classes included), lives under ``rlhf/plugins/`` (or is a public type of
  ``rlhf.core``) and imports rlhf only through the plugin API, ``rlhf.api`` (plus ``rlhf.sandbox``,
  untrusted code's runner, and its own plugin package); so does every module ``rlhf plugins new``
  writes, for every kind;
* the host never imports ``rlhf.api`` (it is the plugins' door, so no circle can pass through it);
* the fast paths sit beside the core, not in it: ``rlhf.core`` never imports ``rlhf.fastpaths``,
  which imports only ``rlhf.core`` and itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlhf.core.plugin_host.kinds import KINDS
from rlhf.core.plugin_host.loading import DEFAULT_PLUGINS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlhf"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _owner(name: str) -> str | None:
    """The rlhf module an imported name lives in (``rlhf.core.types.Trajectory`` -> ``rlhf.core.types``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


class _Imports(ast.NodeVisitor):
    """Every rlhf module a file imports, at any depth, ``if TYPE_CHECKING:`` blocks included."""

    def __init__(self, module: str, is_package: bool):
        self.module, self.is_package = module, is_package
        self.found: set[str] = set()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")[: len(self.module.split(".")) - node.level + (1 if self.is_package else 0)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            self._add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)

    def _add(self, name: str) -> None:
        owner = _owner(name) if name.startswith("rlhf") else None
        if owner and owner != self.module:
            self.found.add(owner)


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text()))
    return visitor.found


GRAPH = {module: imports_of(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_between_modules():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_function_level_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_function_level_and_type_checking_imports_are_edges():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rlhf.runtime.rl.trainer\n"
              "def f():\n    from rlhf.core import types\n")
    visitor = _Imports("rlhf.core.example", False)
    visitor.visit(ast.parse(source))
    assert visitor.found == {"rlhf.core.types", "rlhf.runtime.rl.trainer"}


PACKAGES = sorted({p.parent for p in PACKAGE.rglob("*.py")})


@pytest.mark.parametrize("folder", PACKAGES, ids=[str(p.relative_to(ROOT)) for p in PACKAGES])
def test_no_package_holds_more_than_15_modules_side_by_side(folder):
    modules = sorted(p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 15, f"{folder.relative_to(ROOT)} holds {len(modules)} modules: split it by concept"


HOST = [m for m in MODULES if not m.startswith("rlhf.plugins")]


@pytest.mark.parametrize("module", HOST)
def test_the_host_reaches_plugins_only_through_registries(module):
    plugin_imports = sorted(name for name in GRAPH[module] if name.startswith("rlhf.plugins"))
    assert plugin_imports == [], f"{module} imports {plugin_imports}"


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("rlhf.core")])
def test_the_core_never_imports_a_fast_path(module):
    assert sorted(name for name in GRAPH[module] if name.startswith("rlhf.fastpaths")) == []


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("rlhf.fastpaths")])
def test_fast_paths_import_only_the_core_and_each_other(module):
    assert sorted(name for name in GRAPH[module]
                  if not name.startswith(("rlhf.core", "rlhf.fastpaths"))) == [], module


PLUGIN_API = ("rlhf.api", "rlhf.sandbox")  # what a plugin may import of rlhf, besides its own package


def allowed_for(module: str) -> tuple[str, ...]:
    package = ".".join(module.split(".")[:3])  # rlhf.plugins.<package>
    return (*PLUGIN_API, package) if module.startswith("rlhf.plugins.") else PLUGIN_API


def violations(imported: set[str], allowed: tuple[str, ...]) -> list[str]:
    return sorted(name for name in imported if not any(name == a or name.startswith(a + ".") for a in allowed))


def public_api_violations(module: str) -> list[str]:
    return violations(GRAPH[module], allowed_for(module))


@pytest.mark.parametrize("module", HOST)
def test_the_host_never_imports_the_plugin_api(module):
    assert "rlhf.api" not in GRAPH[module], f"{module} imports rlhf.api, the plugins' door"


def _registered_targets() -> list[tuple[str, str]]:
    """(component, module) for every object and config class the built-in plugins register."""
    from rlhf.core.plugin_host.loading import build_plugin_manager

    plugins = build_plugin_manager(load_entrypoints=False)
    targets = []
    for registry in plugins.registries().values():
        for component in registry.components():
            for target in (component.target, component.config_cls):
                if target is None:
                    continue
                module = target.partition(":")[0] if isinstance(target, str) else target.__module__
                targets.append((f"{registry.kind.name} {component.name}", module))
    return targets


TARGETS = _registered_targets()


@pytest.mark.parametrize("module", list(DEFAULT_PLUGINS))
def test_builtin_plugin_modules_live_under_plugins_and_use_the_public_api(module):
    assert module.startswith("rlhf.plugins."), f"{module} is a built-in plugin outside rlhf/plugins/"
    assert public_api_violations(module) == []


@pytest.mark.parametrize("component, module", TARGETS, ids=[c for c, _ in TARGETS])
def test_registered_objects_live_under_plugins_and_use_the_public_api(component, module):
    if module.startswith("rlhf.core."):  # a public type itself (AdvantageConfig, an AlgorithmPreset)
        return
    assert module.startswith("rlhf.plugins."), f"{component} is registered from {module}, outside rlhf/plugins/"
    assert public_api_violations(module) == [], f"{component} ({module})"


def test_the_public_api_check_catches_a_plugin_that_imports_past_the_api():
    GRAPH["rlhf.plugins.example.thing"] = {"rlhf.api", "rlhf.sandbox", "rlhf.plugins.example.other", "rlhf",
                                           "rlhf.core.types", "rlhf.objectives", "rlhf.fastpaths.packing",
                                           "rlhf.runtime.rl.trainer", "rlhf.plugins.other.x"}
    try:
        assert public_api_violations("rlhf.plugins.example.thing") == [
            "rlhf", "rlhf.core.types", "rlhf.fastpaths.packing", "rlhf.objectives", "rlhf.plugins.other.x",
            "rlhf.runtime.rl.trainer"]
    finally:
        del GRAPH["rlhf.plugins.example.thing"]


@pytest.fixture(scope="module")
def scaffolded(tmp_path_factory):
    """Every module ``rlhf plugins new`` writes, one package per kind: (kind, file, rlhf modules it imports)."""
    from rlhf.plugin_kit.scaffold import SPECS, new_package

    out = []
    for kind in sorted(SPECS):
        root = new_package(kind, "my_thing", tmp_path_factory.mktemp(kind))
        for path in sorted(root.rglob("*.py")):
            visitor = _Imports("rlhf_my_thing", False)
            visitor.visit(ast.parse(path.read_text()))
            out.append((kind, str(path.relative_to(root)), visitor.found))
    return out


def test_what_plugins_new_writes_imports_rlhf_only_through_the_plugin_api(scaffolded):
    assert {kind for kind, _, _ in scaffolded} == set(KINDS)
    wrong = {f"{kind}: {path}": violations(found, PLUGIN_API) for kind, path, found in scaffolded
             if violations(found, PLUGIN_API)}
    assert wrong == {}
    assert any("rlhf.api" in found for _, _, found in scaffolded)
