"""Listing, describing and asking for help about the ``vllm`` engine never imports vLLM.

A fake ``vllm`` package that any import would load is put first on the path of a fresh process;
the commands run there, then the process reports whether ``vllm`` was imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from click.testing import CliRunner
from rlhf.cli.main import make_cli
from rlhf.core.plugin_host.loading import build_plugin_manager

plugins = build_plugin_manager()
outputs = {}
for args in (["--help"], ["plugins", "list", "--all"], ["plugins", "show", "vllm"], ["train", "--help"]):
    result = CliRunner().invoke(make_cli(plugins), args)
    assert result.exit_code == 0, (args, result.output)
    outputs[" ".join(args)] = result.output
import rlhf.plugins.engines.vllm_engine, rlhf.plugins.engines.vllm_weights, rlhf.runtime.rl.local
print(json.dumps({"imported": "vllm" in sys.modules, "outputs": outputs}))
"""


def test_commands_and_modules_do_not_import_vllm(tmp_path):
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.11.0'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)]), "RLHF_LOAD_PLUGINS": ""}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["imported"] is False
    assert "--engine" in report["outputs"]["train --help"]
    assert "VLLMEngineConfig" in report["outputs"]["plugins show vllm"]
    assert any(line.split()[:2] == ["rollout_engine", "vllm"]
               for line in report["outputs"]["plugins list --all"].splitlines())
    # the fake is importable in that process, so the check could have seen an import
    check = subprocess.run([sys.executable, "-c", "import vllm, sys; print('vllm' in sys.modules)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert check.stdout.strip() == "True"
