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


MISSING = "./runs/sft/final"  # a path, as `rlhf sft --out runs/sft` would make it: here there is none
MODEL_PATH_PROBE = f"""
import json, os, sys, tempfile
os.environ["HF_HUB_OFFLINE"] = "1"  # a hub name is looked up in the cache only
from click.testing import CliRunner
from rlhf.cli.main import make_cli
from rlhf.core.plugin_host.loading import build_plugin_manager

data = ["--data", "examples/data/train.jsonl"]
model = ["--model", {MISSING!r}, *data]
where = tempfile.mkdtemp()  # nothing is written there: a command that wrote would fail the next case
run = ["--out", where + "/run"]
said = ["{MISSING}: no such model directory, and not a hub model name (owner/name)"]
cases = [(["train", *model, "--label-key", "answer", "--reward", "exact_match", *run], said),
         *[([name, *model, *run], said) for name in ("sft", "rm", "dpo", "kto", "prm")],
         (["distill", *model, "--teacher", "examples/tiny-model", *run], said),
         (["fit", "--objective", "sft", *model, *run], said),
         (["generate", *model, "--out", where + "/gen.jsonl"], said),
         (["eval", *model, "--label-key", "answer", "--reward", "exact_match"], said),
         (["iterate", *model, "--label-key", "answer", "--reward", "exact_match", *run], said),
         (["chat", {MISSING!r}], ["MODEL " + said[0]]),
         (["generate", "--model", "examples/tiny-model", "--tokenizer", "a/b/c", *data,
           "--out", where + "/g.jsonl"],
          ["--tokenizer a/b/c: no such model directory, and not a hub model name"]),
         (["merge-lora", "examples/tiny-model", "--base", {MISSING!r}, "--out", where + "/merged"],
          ["--base {MISSING}: no such model directory"]),
         # two mistakes: the one the run would say first (it checks these before it loads a model) comes first
         (["train", *model, "--reward", "exact_match", *run],
          ["reward 'exact_match' compares completions with labels"]),
         (["generate", *model, "--reward", "exact_match", "--out", where + "/gen.jsonl"],
          ["reward 'exact_match' compares completions with labels"]),
         (["train", *model, "--label-key", "answer", "--reward", "exact_match", "--algo", "ppo", "--critic-model",
           "rlhf-tests/no-such-model", *run], ["--critic-model rlhf-tests/no-such-model: not a local directory"]),
         (["distill", *model, "--teacher", "rlhf-tests/no-such-model", *run],
          ["--teacher rlhf-tests/no-such-model: not a local directory"]),
         (["train", *model, "--label-key", "answer", "--reward", "exact_match", "--out", "examples/data"],
          ["--out examples/data is not empty and holds no run"]),
         (["iterate", *model, "--label-key", "answer", "--reward", "exact_match", "--out", "examples/data"],
          ["--out examples/data is not empty and holds no run"])]
out = []
for args, words in cases:
    result = CliRunner().invoke(make_cli(build_plugin_manager()), args)
    out.append([args, words, result.exit_code, result.output, [m for m in {HEAVY!r} if m in sys.modules]])
assert os.listdir(where) == [], os.listdir(where)  # nothing written, not even a lock file
os.rmdir(where)
print(json.dumps(out))
"""


def test_a_model_path_that_is_nothing_is_one_line_before_torch_loads():
    """ux-4: ``--model ./runs/sft/final`` where there is no such folder is said in a moment, by every
    command that takes a model, after the checks the run makes before it loads one (their errors
    come first, as tests/datagen/test_labels.py, tests/runtime/test_hub_models.py and
    tests/runtime/test_run_ownership.py show with a model that is not there)."""
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", MODEL_PATH_PROBE], capture_output=True, text=True, check=True,
                            cwd=str(root))
    for args, words, code, output, heavy in json.loads(result.stdout.strip().splitlines()[-1]):
        assert code == 2, (args, output)
        assert output.startswith("Error: ") and len(output.splitlines()) == 1, (args, output)
        assert all(word in output for word in words), (args, output)
        assert heavy == [], (args, output, heavy)
    assert not (root / "runs" / "sft" / "final").exists()


def test_what_may_be_a_hub_model_is_left_to_the_hub(tmp_path, plugins):
    """``owner/name`` (and a bare ``name``, as the hub's oldest models) that names no folder here is a
    hub model to download: not refused before torch loads (offline mode says so later, as before)."""
    from rlhf.cli.commands import check_model_paths
    from rlhf.core.errors import ConfigError
    from rlhf.core.hub import check_model_path

    for ref in ("some-org/some-model", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path)):
        check_model_path(ref, "--model")
    for ref in ("./runs/sft/final", "runs/sft/final", "../model", "~/no-such-model", str(tmp_path / "nope"),
                "my model/x", "org/name--x", "org/../name"):
        with pytest.raises(ConfigError, match=r"^--model .*: no such model directory, and not a hub model name"):
            check_model_path(ref, "--model")

    class Config:  # the model options preflight looks at
        model, tokenizer, critic_model, teacher = "some-org/some-model", None, None, "gpt2"

    def before_models():
        raise AssertionError("called only before a wrong model path is said")

    check_model_paths(Config(), before_models)
    Config.tokenizer = "./no/such/tokenizer"
    with pytest.raises(AssertionError, match="called only before"):
        check_model_paths(Config(), before_models)
    with pytest.raises(ConfigError, match=r"^--tokenizer \./no/such/tokenizer: no such model directory"):
        check_model_paths(Config())
