"""``rlhf plugins check NAME``: find the component(s) called NAME, time their plugin's import, and
run each one's contract check (`rlhf.plugin_kit.checks`).

The import is timed in a fresh interpreter: the plugin module is imported and its registration
hooks run, as every ``rlhf`` command does. Above `SLOW_IMPORT_MS` the report warns: heavy
imports (torch, transformers, ...) belong inside the objects registered as ``"module:attr"``.
"""

from __future__ import annotations

import inspect

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.loading import PluginRecord, PluginSet
from rlhf.core.plugin_host.references import is_reference, resolve
from rlhf.core.plugin_host.registry import declared_registration, normalize_name
from rlhf.plugin_kit.checks import Target, check_for

SLOW_IMPORT_MS = 100.0
HEAVY = ("torch", "transformers", "datasets", "peft", "numpy", "ray", "deepspeed", "vllm", "pandas", "scipy")

_PROBE = """
import importlib, json, sys, time
from rlhf.core.plugin_host.loading import build_plugin_manager
plugins = build_plugin_manager(load_entrypoints=False, builtins=())
before = set(sys.modules)
start = time.perf_counter()
plugins.register(importlib.import_module(sys.argv[1]), sys.argv[1])
plugins.registries()
seconds = time.perf_counter() - start
heavy = sorted(m for m in sys.argv[2].split(",") if m in sys.modules and m not in before)
print(json.dumps({"ms": seconds * 1000, "heavy": heavy}))
"""


class NoSuchComponent(RlhfError):
    pass


@dataclass
class ImportTime:
    module: str
    ms: float
    heavy: list[str]

    @property
    def slow(self) -> bool:
        return self.ms > SLOW_IMPORT_MS

    def describe(self) -> str:
        line = f"import time of plugin module {self.module}: {self.ms:.1f} ms"
        if not self.slow:
            return line
        cause = f" (it imports {', '.join(self.heavy)})" if self.heavy else ""
        return (f"warning: {line}, over {SLOW_IMPORT_MS:.0f} ms{cause}: every `rlhf` command pays it. Import heavy "
                'libraries inside your functions, or register the object as a "module:attr" string')


def targets(name: str, plugins: PluginSet) -> list[tuple[Target, PluginRecord | None]]:
    """Every component called ``name`` (one per kind), or the ``module:attr`` object ``name``: a class
    as an env, a function as an agent (the kinds a run takes by reference without a plugin)."""
    if is_reference(name):
        obj = resolve(name).obj
        kind = plugins.registry("env" if inspect.isclass(obj) else "agent").kind
        config_cls, capabilities = declared_registration(kind, obj, name)
        return [(Target(kind.name, name, obj, config_cls, capabilities, plugins), None)]
    key, found = normalize_name(name), []
    for registry in plugins.registries().values():
        if any(key in (c.name, *c.aliases) for c in registry.components()):
            component = registry.component(name)  # a name two plugins provide fails here
            target = Target(registry.kind.name, component.name, component.load(), component.load_config_cls(),
                            dict(component.capabilities), plugins)
            found.append((target, component.provider))
    if not found:
        raise NoSuchComponent(f"no component called {name!r}; see `rlhf plugins list --all`")
    return found


def import_time(record: PluginRecord) -> ImportTime | None:
    """How long importing and registering the plugin's module takes in a fresh interpreter (None for
    an object registered in-process, which has no module of its own to import)."""
    module = getattr(record.plugin, "__name__", None)
    if record.source == "inline" or not module or sys.modules.get(module) is not record.plugin:
        return None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's path
    result = subprocess.run([sys.executable, "-c", _PROBE, module, ",".join(HEAVY)], capture_output=True, text=True,
                            env=env)
    if result.returncode != 0:
        return None  # the check itself reports a plugin that cannot load
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return ImportTime(module, data["ms"], data["heavy"])


def run_checks(name: str, plugins: PluginSet, *, tolerance: float | None = None) -> Iterator[tuple[str, list[str]]]:
    """``(heading, lines)`` per component called ``name``; raises `ContractError` on a broken contract.
    ``tolerance``: of the reference fixtures (None: theirs)."""
    timed: set[int] = set()
    for target, record in targets(name, plugins):
        target.tolerance = tolerance
        heading = f"{target.kind} {target.name}" + (f" (from {record.label})" if record else "")
        lines: list[str] = []
        if record is not None and id(record) not in timed:
            timed.add(id(record))
            timing = import_time(record)
            if timing is not None:
                lines.append(timing.describe())
        check = check_for(target.kind)
        if check is None:
            yield heading, lines + ["no contract check for this kind yet"]
            continue
        if target.capabilities.get("needs_gpu") and not _has_cuda():
            yield heading, lines + ["skipped: it needs a GPU and none is visible"]
            continue
        yield heading, lines + check(target) + ["ok: the contract holds"]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
