"""Fixtures and helpers shared by the tests (loaded through ``pytest_plugins``)."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from rlhf.cli.main import make_cli
from rlhf.core.plugins import PluginSet, build_plugin_manager


@pytest.fixture
def plugins() -> PluginSet:
    """A fresh plugin set with the built-ins and no installed entry points."""
    return build_plugin_manager(load_entrypoints=False)


def run_cli(plugins: PluginSet, args: list[str]) -> Result:
    return CliRunner().invoke(make_cli(plugins), args, catch_exceptions=False)


class FakeSite:
    """A folder on sys.path holding hand-written ``.dist-info`` folders and plugin modules,
    so entry-point discovery is tested without installing anything."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: list[str] = []

    def add(self, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[rlhf]\n{lines}\n")
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)
        importlib.invalidate_caches()


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    site = FakeSite(tmp_path / "site")
    site.root.mkdir()
    monkeypatch.syspath_prepend(str(site.root))
    yield site
    for module in site.modules:
        sys.modules.pop(module, None)


@pytest.fixture
def make_plugin() -> Callable[..., types.ModuleType]:
    """Build a plugin module from hook functions: ``make_plugin("name", register_rewards=fn)``."""
    import rlhf

    def factory(name: str = "test_plugin", **hooks: Callable[..., Any]) -> types.ModuleType:
        module = types.ModuleType(name)
        for hook, fn in hooks.items():
            setattr(module, hook, fn if hasattr(fn, "rlhf_impl") else rlhf.hookimpl(fn))  # keep trylast=True etc.
        return module

    return factory


ROOT = Path(__file__).resolve().parents[1]


# A toy task for short training runs: 12 addition prompts with labels, and a reward that grows
# with the completion's length (so every run has signal, whatever the random model writes).
ADDITION_PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(4) for b in range(3)]
LENGTH_REWARD = "def reward_func(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n"


def write_task(root: Path) -> Path:
    """``root/data.jsonl`` (ADDITION_PROMPTS) and ``root/rewards.py`` (LENGTH_REWARD as ``reward_func``)."""
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ADDITION_PROMPTS))
    (root / "rewards.py").write_text(LENGTH_REWARD)
    return root


@pytest.fixture(scope="session")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy task's files, written once per session (tests must not write into it)."""
    return write_task(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama (hidden 64, 2 layers, vocab 320) and its tokenizer, built once per session."""
    from rlhf.core.references import import_object

    build = import_object(f"{ROOT / 'examples' / 'tiny_model.py'}:build_random_model")
    return build(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def bare_plugins() -> PluginSet:
    """A fresh plugin set with no built-ins and no entry points: for tests of the registry mechanics
    that register their own components (k1, grpo, ...) without clashing with rlhf's."""
    return build_plugin_manager(load_entrypoints=False, builtins=())
