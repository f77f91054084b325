"""Weights & Biases: ``--wandb-project`` with ``--wandb-group`` and ``--wandb-run-name`` reach
``wandb.init``, every metrics row reaches the run (a stand-in ``wandb`` module records the calls);
a missing package, or a group without a project, is a usage error before any model loads."""

from __future__ import annotations

import sys
import types

import pytest

from tests.helpers import read_jsonl, run_cli


class FakeRun:
    def __init__(self, **kwargs):
        self.init, self.rows, self.finished = kwargs, [], False

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` module (importlib finds it) whose ``init`` records its arguments."""
    import importlib.machinery

    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = lambda **kwargs: runs.append(FakeRun(**kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


@pytest.mark.run
def test_group_and_run_name_reach_wandb_and_every_row_is_logged(fake_wandb, tiny_model_dir, fit_data, tmp_path,
                                                                plugins):
    out = tmp_path / "sft"
    result = run_cli(plugins, ["sft", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"),
                               "--batch-size", "2", "--steps", "2", "--out", str(out), "--no-progress",
                               "--wandb-project", "proj", "--wandb-group", "sweep-1", "--wandb-run-name", "seed-42"])
    assert result.exit_code == 0, result.output
    (run,) = fake_wandb
    assert (run.init["project"], run.init["group"], run.init["name"]) == ("proj", "sweep-1", "seed-42")
    assert run.init["config"]["wandb_group"] == "sweep-1"
    assert [(step, metrics["train/loss"]) for step, metrics in run.rows] == [
        (row["step"], row["train/loss"]) for row in read_jsonl(out / "metrics.jsonl")]
    assert run.finished


@pytest.mark.run
def test_the_run_name_defaults_to_the_out_folder(fake_wandb, tiny_model_dir, fit_data, tmp_path, plugins):
    result = run_cli(plugins, ["sft", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"),
                               "--batch-size", "2", "--steps", "1", "--out", str(tmp_path / "my-run"), "--no-progress",
                               "--wandb-project", "proj"])
    assert result.exit_code == 0, result.output
    assert (fake_wandb[0].init["name"], fake_wandb[0].init["group"]) == ("my-run", None)


@pytest.mark.unit
@pytest.mark.parametrize("command", ["train", "sft"])
def test_without_the_package_or_the_project_it_is_a_usage_error_before_models_load(command, task, tmp_path, plugins,
                                                                                   monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    base = [command, "--model", str(tmp_path / "no-model"), "--data", str(task / "data.jsonl"), "--out",
            str(tmp_path / "run")] + (["--label-key", "answer", "--reward", "exact_match"] if command == "train" else [])
    result = run_cli(plugins, base + ["--wandb-project", "p"])
    assert result.exit_code == 2 and "pip install 'rlhf-core[wandb]'" in result.output, result.output
    result = run_cli(plugins, base + ["--wandb-group", "g"])
    assert result.exit_code == 2 and "add --wandb-project" in result.output, result.output
