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


def test_a_resumed_runs_config_yaml_starts_a_fresh_run(tiny_model_dir, task, tmp_path, plugins):
    import shutil

    import yaml

    out = tmp_path / "run"
    assert run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "2", "--save-every", "1",
                                       "--keep-checkpoints", "3")).exit_code == 0
    shutil.rmtree(out / "final")  # as a run killed after step 1 leaves it
    shutil.rmtree(out / "checkpoints" / "step_2")
    again = run_cli(plugins, ["train", "--config", str(out / "config.yaml"), "--resume"])
    assert again.exit_code == 0, again.output
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert "resume" not in saved and "resume_override" not in saved
    assert not list(out.glob("config.until_*.yaml"))  # nothing changed: nothing to keep
    fresh = run_cli(plugins, ["train", "--config", str(out / "config.yaml"), "--out", str(tmp_path / "fresh")])
    assert fresh.exit_code == 0, fresh.output
    assert [row["step"] for row in read_jsonl(tmp_path / "fresh" / "metrics.jsonl")] == [1, 2]


def test_single_turn_samples_and_evals_have_no_env_reward(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1", "--eval-data",
                                         str(task / "data.jsonl"), "--eval-max-samples", "2"))
    assert result.exit_code == 0, result.output
    samples = read_jsonl(out / "samples.jsonl")
    assert samples and all(set(s["rewards"]) == {"reward_func"} for s in samples), samples[0]["rewards"]
    assert not any(k.endswith("/env") for row in read_jsonl(out / "metrics.jsonl") for k in row)
    rows = tmp_path / "rows.jsonl"
    result = run_cli(plugins, ["eval", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--label-key", "answer", "--reward", str(task / "rewards.py"), "--max-samples", "2",
                               "--max-new-tokens", "3", "--json", "--out", str(rows)])
    assert result.exit_code == 0, result.output
    assert "eval/reward/env" not in json.loads(result.output.strip().splitlines()[-1])
    assert all("env" not in row["rewards"] for row in read_jsonl(rows))


def test_eval_at_temperature_0_does_not_report_pass_at_n_of_identical_samples(tiny_model_dir, task, plugins, caplog):
    base = ["eval", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--label-key", "answer",
            "--reward", str(task / "rewards.py"), "--max-samples", "2", "--max-new-tokens", "3", "--n-samples", "3",
            "--json"]
    greedy = run_cli(plugins, [*base, "--temperature", "0"])
    assert greedy.exit_code == 0, greedy.output
    metrics = json.loads(greedy.output.strip().splitlines()[-1])
    assert "eval/pass@1" in metrics and "eval/pass@3" not in metrics
    assert "--temperature 0 is greedy: the 3 samples of a prompt are one answer" in caplog.text
    sampled = run_cli(plugins, [*base, "--temperature", "1"])
    assert "eval/pass@3" in json.loads(sampled.output.strip().splitlines()[-1])


def test_lora_merges_keep_the_prompt_format_and_the_card(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    result = run_cli(plugins, train_args(tiny_model_dir, task, out, "--steps", "1", "--lora-rank", "4",
                                         "--merge-lora"))
    assert result.exit_code == 0, result.output
    final = out / "final"
    recorded = (final / "prompt_format.json").read_text()
    assert json.loads(recorded) == {"apply_chat_template": False, "input_template": None}
    assert (final / "merged" / "prompt_format.json").read_text() == recorded  # --merge-lora
    card = (final / "merged" / "README.md").read_text()
    assert card.startswith(f"# {out.name}") and "adapter" not in card.split("\n\n")[-1]
    merged = tmp_path / "merged"
    result = run_cli(plugins, ["merge-lora", str(final), "--out", str(merged)])  # rlhf merge-lora
    assert result.exit_code == 0, result.output
    assert (merged / "prompt_format.json").read_text() == recorded
    assert "rlhf merge-lora" in (merged / "README.md").read_text()
    assert "This directory is a LoRA adapter" not in (merged / "README.md").read_text()
    assert "Loading weights" not in result.output and "Writing model shards" not in result.output  # quiet
    chat = run_cli(plugins, ["chat", str(merged), "--temperature", "0", "--max-new-tokens", "2"], input="23+45=\n")
    assert chat.exit_code == 0 and "(plain text, no chat template)" in chat.output, chat.output


def test_readmes_prm_example_runs_on_the_shipped_data(tiny_model_dir, tmp_path, plugins):
    import shlex

    from tests.helpers import ROOT

    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("rlhf prm "))
    args = shlex.split(line.split("#")[0])[1:]
    args[args.index("--model") + 1] = str(tiny_model_dir)
    args[args.index("--data") + 1] = str(ROOT / "examples" / "pipeline" / "steps.jsonl")
    args[args.index("--out") + 1] = str(tmp_path / "prm")
    result = run_cli(plugins, [*args, "--steps", "1", "--batch-size", "2", "--micro-batch-size", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "prm" / "final" / "config.json").is_file()
