"""``rlhf eval``: the eval of ``rlhf train --eval-data`` as a command. Greedy, its metrics equal the
eval a training run reports before its first step (same names, same values); --json, --out, and
what it refuses."""

from __future__ import annotations

import json

import pytest

from tests.helpers import read_jsonl, run_cli

PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 13) for b in range(20, 22)]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


@pytest.mark.run
def test_greedy_eval_reports_what_the_training_runs_eval_reports_before_step_1(plugins, tiny_model_dir, prompts,
                                                                              tmp_path):
    common = ["--label-key", "answer", "--reward", "exact_match", "--max-new-tokens", "6",
              "--max-prompt-length", "64"]
    run = tmp_path / "run"
    trained = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(prompts), "--eval-data",
                                str(prompts), "--eval-n-samples", "2", "--eval-temperature", "0", "--n-samples", "2",
                                "--prompts-per-step", "2", "--steps", "1", "--out", str(run), "--no-progress",
                                *common])
    assert trained.exit_code == 0, trained.output
    before_training = next(row for row in read_jsonl(run / "metrics.jsonl") if row["step"] == 0)
    expected = {k: v for k, v in before_training.items() if k.startswith("eval/")}

    result = run_cli(plugins, ["eval", "--model", str(tiny_model_dir), "--data", str(prompts), "--n-samples", "2",
                               "--temperature", "0", "--json", "--out", str(tmp_path / "samples.jsonl"), *common])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output.strip().splitlines()[-1])
    assert metrics.keys() == expected.keys() and {"eval/pass@1", "eval/reward/exact_match"} <= set(metrics)
    assert "eval/pass@2" not in metrics  # greedy: the 2 samples are one answer (issue 53), in both evals
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-6), name
    rows = read_jsonl(tmp_path / "samples.jsonl")
    assert len(rows) == len(PROMPTS) * 2
    assert [row["label"] for row in rows[::2]] == [p["answer"] for p in PROMPTS]
    mean = sum(row["reward"] for row in rows) / len(rows)
    assert mean == pytest.approx(metrics["eval/reward/mean"])
    assert all(row["reward"] == float(row["completion"].strip() == row["label"]) for row in rows)  # exact match


@pytest.mark.run
def test_the_table_names_each_metric(plugins, tiny_model_dir, prompts):
    result = run_cli(plugins, ["eval", "--model", str(tiny_model_dir), "--data", str(prompts), "--label-key",
                               "answer", "--reward", "exact_match", "--n-samples", "1", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    lines = dict(line.split(maxsplit=1) for line in result.output.strip().splitlines())
    assert float(lines["eval/prompts"]) == len(PROMPTS) and "eval/pass@1" in lines and "eval/pass@2" not in lines


@pytest.mark.unit
@pytest.mark.parametrize("args, message", [
    ([], "--reward is required"),
    (["--reward", "exact_match"], "pass --label-key COLUMN"),
    (["--reward", "exact_match", "--label-key", "answer", "--temperature", "-1"], "--temperature must be >= 0"),
])
def test_what_eval_refuses_before_any_model_loads(plugins, prompts, tmp_path, args, message):
    result = run_cli(plugins, ["eval", "--model", str(tmp_path / "no-model"), "--data", str(prompts), *args])
    assert result.exit_code == 2 and message in result.output, result.output
