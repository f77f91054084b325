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


CHEAP_ERROR_PROBE = f"""
import json, sys
from click.testing import CliRunner
from rlhf.cli.main import make_cli
from rlhf.core.plugin_host.loading import build_plugin_manager

common = ["--model", "examples/tiny-model", "--data", "examples/data/train.jsonl", "--out", "/nonexistent/run"]
cases = [["train", "--lr", "-1", "--reward", "examples/rewards.py:exact_match", *common],
         ["train", "--steps", "0", "--reward", "exact_match", *common],
         ["train", "--model", "examples/tiny-model", "--data", "no-such-file.jsonl", "--reward", "exact_match"],
         ["sft", "--lr", "-1", *common], ["dpo", "--batch-size", "0", *common],
         ["generate", "--temperature", "-1", *common],
         # component settings against the ranges their config classes declare (issue 53's --lora-rank -4)
         ["train", "--lora-rank", "-4", "--reward", "exact_match", *common], ["sft", "--lora-rank", "-4", *common],
         ["generate", "--model-adapter.lora-rank", "-4", *common],
         ["train", "--backend", "deepspeed", "--zero-stage", "7", "--reward", "exact_match", *common],
         ["train", "--advantage.gamma", "2", "--reward", "exact_match", *common],
         ["dpo", "--beta", "-1", *common]]
out = []
for args in cases:
    result = CliRunner().invoke(make_cli(build_plugin_manager()), args)
    out.append([result.exit_code, result.output, [m for m in {HEAVY!r} if m in sys.modules]])
print(json.dumps(out))
"""


def test_cheap_usage_errors_are_one_line_before_torch_loads():
    """issue 53: ranges (the commands' own and the components' settings'), conflicts and missing files
    are said before torch, transformers and datasets import, as one ``Error:`` line without click's
    Usage/Try banner."""
    result = subprocess.run([sys.executable, "-c", CHEAP_ERROR_PROBE], capture_output=True, text=True, check=True,
                            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    for code, output, heavy in json.loads(result.stdout.strip().splitlines()[-1]):
        assert code == 2, output
        assert output.startswith("Error: ") and len(output.splitlines()) == 1, output
        assert "Usage:" not in output and "Try " not in output, output
        assert heavy == [], (output, heavy)
    outputs = [output for _, output, _ in json.loads(result.stdout.strip().splitlines()[-1])]
    assert outputs[6:] == ["Error: the 'hf' model: --lora-rank must be at least 0; got -4\n"] * 3 + [
        "Error: the 'deepspeed' train backend: --zero-stage must be in [0, 3]; got 7\n",
        "Error: --advantage.gamma must be in [0, 1]; got 2.0\n",
        "Error: the 'dpo' objective: --objective.beta must be greater than 0; got -1.0\n"]
