"""Installing every example plugin (examples/plugins/* and the README's) keeps ``rlhf --help`` fast:
under 2x its time without them, measured side by side in one run (a ratio, not a clock)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers import pip_install, readme_plugin_files

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 7


def _example_sources(tmp_path: Path) -> list[Path]:
    sources = []
    for package in sorted((ROOT / "examples" / "plugins").iterdir()):
        sources.append(tmp_path / "src" / package.name)
        shutil.copytree(package, sources[-1], ignore=shutil.ignore_patterns("build", "*.egg-info"))
    readme = tmp_path / "src" / "readme-plugin"
    for relative, text in readme_plugin_files().items():
        (readme / relative).parent.mkdir(parents=True, exist_ok=True)
        (readme / relative).write_text(text)
    return [*sources, readme]


def _help_seconds(pythonpath: str) -> float:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlhf", "--help"], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def test_installed_example_plugins_keep_rlhf_help_under_twice_its_time(tmp_path):
    site = tmp_path / "site"
    sources = _example_sources(tmp_path)
    for source in sources:
        pip_install(source, site)
    base = os.pathsep.join(sys.path)
    with_plugins = os.pathsep.join([str(site), base])
    listed = subprocess.run([sys.executable, "-m", "rlhf", "plugins", "list", "--json"], check=True,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": with_plugins}).stdout
    rows = [r for r in json.loads(listed) if r["source"] == "entrypoint"]
    assert len(rows) == len(sources) and all(r["status"] == "ok" for r in rows), rows

    _help_seconds(base), _help_seconds(with_plugins)  # warm the file cache for both
    without, with_ = [], []
    for _ in range(ROUNDS):  # interleaved, so machine noise hits both alike
        without.append(_help_seconds(base))
        with_.append(_help_seconds(with_plugins))
    ratio = statistics.median(with_) / statistics.median(without)
    print(f"rlhf --help: {statistics.median(without):.3f} s without plugins, {statistics.median(with_):.3f} s "
          f"with {len(sources)} example plugins: ratio {ratio:.2f}")
    assert ratio < 2.0, f"installing the example plugins made `rlhf --help` {ratio:.1f}x slower"
