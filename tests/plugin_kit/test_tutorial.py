"""docs/plugins.md is true: its commands run as written, in order (``pip install -e`` becomes an
install into a temporary --target folder, so the test environment is left untouched), from
``plugins new`` to a trained run, for the walk-through and for every kind."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from rlhf.plugin_kit.scaffold import SPECS
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "plugins.md").read_text()


def _blocks(section: str) -> dict[str, list[str]]:
    """``### heading`` (or the section itself) -> the lines of its bash block."""
    text = DOC.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### (\S+)$", text, flags=re.M)
    found = {section: parts[0]} | dict(zip(parts[1::2], parts[2::2]))
    return {name: re.search(r"```bash\n(.*?)```", body, re.S).group(1).strip().splitlines()
            for name, body in found.items() if "```bash" in body}


WALKTHROUGH = _blocks("Five minutes: a reward, from nothing to a trained run")
KINDS = _blocks("Every kind")


def run_tutorial(lines: list[str], workdir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Run the lines in ``workdir`` (which sees the repository's examples/); return each one's output.

    pip and pytest run as processes of their own; the ``rlhf`` lines run in this process, through the
    command line a new process would run (`run_cli`), with the install folder first on sys.path as
    the new process would have it: a process each would only import torch again. The plugin's modules
    leave with the test."""
    (workdir / "examples").symlink_to(ROOT / "examples")
    site = workdir / "site"
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(site))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    outputs = {}
    try:
        for line in lines:
            argv = shlex.split(line)
            if argv[0] == "rlhf":
                importlib.invalidate_caches()  # see what pip installed
                result = run_cli(build_plugin_manager(), argv[1:])
                assert result.exit_code == 0, f"`{line}` failed:\n{result.output[-6000:]}"
                outputs[line] = result.stdout
                continue
            if argv[:3] == ["pip", "install", "-e"]:
                argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(site), argv[3]]
            elif argv[:3] == ["python", "-m", "pytest"]:
                argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv[3:]]
            else:
                raise AssertionError(f"the tutorial runs a command this test does not know: {line}")
            result = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
            assert result.returncode == 0, f"`{line}` failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            outputs[line] = result.stdout
    finally:
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(site)):
                del sys.modules[name]
    return outputs


@pytest.mark.unit
def test_the_tutorial_covers_every_kind():
    assert sorted(KINDS) == sorted(SPECS)
    for kind, lines in KINDS.items():
        assert lines[0].startswith(f"rlhf plugins new {kind} ") and lines[1].startswith("pip install -e ")
        assert "plugins check" in lines[2] and "pytest" in lines[3]
        assert lines[4].startswith(("rlhf train ", "rlhf fit ")), lines[4]


@pytest.mark.run
def test_the_walkthrough_runs_as_written(tmp_path, monkeypatch):
    lines = WALKTHROUGH["Five minutes: a reward, from nothing to a trained run"]
    outputs = run_tutorial(lines, tmp_path, monkeypatch)
    listed = outputs["rlhf plugins list"]
    assert re.search(r"reward\s+contains_label\s+rlhf-contains-label\s+0\.1\.0", listed), listed
    assert "ok: the contract holds" in outputs["rlhf plugins check contains_label"]
    assert "2 passed" in outputs["python -m pytest plugins/rlhf-contains-label"]
    config = (tmp_path / "runs" / "contains_label" / "config.yaml").read_text()
    assert "contains_label" in config
    assert (tmp_path / "runs" / "contains_label" / "final" / "config.json").exists()


@pytest.mark.run
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_kind_goes_from_plugins_new_to_a_trained_run(tmp_path, monkeypatch, kind):
    lines = KINDS[kind]
    name = lines[0].split()[4]
    outputs = run_tutorial(lines, tmp_path, monkeypatch)
    assert "ok: the contract holds" in outputs[lines[2]]
    assert "2 passed" in outputs[lines[3]]
    run = tmp_path / "runs" / name
    assert name in (run / "config.yaml").read_text(), f"the run did not record {name}"
    assert (run / "final" / "config.json").exists()
