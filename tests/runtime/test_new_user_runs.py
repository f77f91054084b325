"""What a new user met that went silently wrong (issue 53), each case run as they ran it, through
the CLI on the tiny model: a reward that abstains everywhere, ``-1`` as "never", the prompt format
through merges, chat turns on plain-prompt models, a resumed run's config, evals at temperature 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import read_jsonl, run_cli

pytestmark = pytest.mark.run


def train_args(model, task, out, *extra):
    return ["train", "--model", str(model), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--prompts-per-step", "2", "--n-samples", "2",
            "--max-new-tokens", "3", "--micro-batch-size", "2", "--lr", "1e-3", "--out", str(out), "--no-progress",
            *extra]


def test_a_reward_that_returns_none_for_every_sample_stops_the_run_like_a_failing_one(tiny_model_dir, task,
                                                                                       tmp_path, plugins):
    (tmp_path / "none.py").write_text("def reward_func(completions, **kwargs):\n    return [None] * len(completions)\n")
    args = train_args(tiny_model_dir, task, tmp_path / "run", "--steps", "6")
    args[args.index("--reward") + 1] = str(tmp_path / "none.py")
    result = run_cli(plugins, args)
    assert result.exit_code == 1, result.output
    assert ("the reward reward_func returned None (abstained) on every sample for 3 steps in a row "
            "(--reward-on-error raise)") in result.output
    assert not (tmp_path / "run" / "final").exists()


def test_a_reward_that_abstains_on_some_samples_only_trains_on(tiny_model_dir, task, tmp_path, plugins):
    (tmp_path / "some.py").write_text("def reward_func(completions, prompts, **kwargs):\n"
                                      "    return [None if i % 2 else 1.0 for i, _ in enumerate(completions)]\n")
    args = train_args(tiny_model_dir, task, tmp_path / "run", "--steps", "4")
    args[args.index("--reward") + 1] = str(tmp_path / "some.py")
    result = run_cli(plugins, args)
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 4


@pytest.mark.parametrize("flag", ["--save-every", "--save-hf-every"])
def test_minus_one_saves_nothing_in_between_in_train(tiny_model_dir, task, tmp_path, plugins, flag):
    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "3", flag, "-1"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3"]
    assert not (out / "checkpoints" / "step_3" / "hf").exists()


def test_minus_one_saves_and_evaluates_nothing_in_between_in_sft(tiny_model_dir, fit_data, tmp_path, plugins):
    out = tmp_path / "sft"
    result = run_cli(plugins, ["sft", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"),
                               "--eval-data", str(fit_data / "sft.jsonl"), "--batch-size", "2", "--micro-batch-size",
                               "2", "--steps", "3", "--save-every", "-1", "--eval-every", "-1", "--save-hf-every", "-1",
                               "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3"]
    evals = [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "eval/loss" in row]
    assert evals == [3]


def test_minus_one_evaluates_train_only_at_the_start_and_the_end(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "3", "--eval-every", "-1",
                                         "--eval-data", str(task / "data.jsonl")))
    assert result.exit_code == 0, result.output
    evals = [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "eval/reward/mean" in row]
    assert evals == [0, 3]
