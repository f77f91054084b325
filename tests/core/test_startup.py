"""`rlhf --help` and `rlhf plugins list` stay fast because nothing heavy is imported for them.
(Timing lives in benchmarks/startup.py; this checks the cause, not the clock.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

HEAVY = ("torch", "transformers", "datasets", "peft", "ray", "deepspeed", "vllm", "numpy")

PROBE = f"""
import json, sys
from click.testing import CliRunner
from rlhf.cli.main import make_cli
from rlhf.core.plugin_host.loading import build_plugin_manager

plugins = build_plugin_manager()
for args in (["--help"], ["plugins", "list", "--all"], ["plugins", "list", "--json"]):
    result = CliRunner().invoke(make_cli(plugins), args)
    assert result.exit_code == 0, result.output
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""


def test_help_and_plugins_list_import_nothing_heavy():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_importing_rlhf_imports_nothing_heavy():
    code = f"import json, sys, rlhf, rlhf.core.types, rlhf.core.plugin_host.hookspecs; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == []
