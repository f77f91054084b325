"""The model card: final/README.md (and best/) says what the model is and how it was made, through
the real CLI for an RL run with LoRA and eval, and for a fit command."""

from __future__ import annotations

import json

import pytest

from rlhf.runtime.run.model_card import model_card
from tests.helpers import run_cli


@pytest.mark.run
def test_an_rl_runs_cards_name_the_base_method_data_metrics_and_lora(tiny_model_dir, task, tmp_path, plugins):
    out = tmp_path / "run"
    result = run_cli(plugins, [
        "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"), "--eval-data",
        str(task / "data.jsonl"), "--label-key", "answer", "--reward", str(task / "rewards.py"), "--n-samples", "2",
        "--prompts-per-step", "2", "--max-new-tokens", "3", "--steps", "2", "--lora-rank", "2", "--save-best",
        "eval/reward/mean", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    card = (out / "final" / "README.md").read_text()
    last = [row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in row][-1]
    assert card.startswith("# run\n")
    assert f"| base model | `{tiny_model_dir}` |" in card
    assert "| method | `grpo` (RL: advantage `grpo`, policy loss `ppo`, KL `k3` in the loss" in card
    assert f"| data | `{task / 'data.jsonl'}` |" in card and "| steps | 2 of 2 |" in card
    assert f"| `reward/mean` | {last['reward/mean']:.4g} |" in card and "| `eval/reward/mean` |" in card
    assert "plain prompts, no chat template" in card
    assert f"LoRA adapter (rank 2) on `{tiny_model_dir}`" in card and "peft" in card  # from adapter_config.json
    assert "TODO" not in card  # not peft's template
    assert f"rlhf train --config {out / 'config.yaml'}" in card  # run from Python: the equivalent command
    best = (out / "best" / "README.md").read_text()
    assert best.startswith("# run: the best model by `eval/reward/mean`") and "LoRA adapter (rank 2)" in best


@pytest.mark.run
def test_a_fit_runs_card(tiny_model_dir, fit_data, tmp_path, plugins):
    out = tmp_path / "sft"
    result = run_cli(plugins, ["sft", "--model", str(tiny_model_dir), "--data", str(fit_data / "sft.jsonl"),
                               "--batch-size", "2", "--steps", "1", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    card = (out / "final" / "README.md").read_text()
    assert "| method | `sft` (offline objective) |" in card and "| `train/loss` |" in card
    assert "adapter" not in card  # full weights
    assert "| steps | 1 of 1 |" in card and "LoRA" not in card


@pytest.mark.unit
def test_the_card_takes_the_rlhf_command_line_when_run_as_rlhf(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/usr/bin/rlhf", "sft", "--model", "m m", "--data", "d.jsonl"])
    card = model_card({"model": "m m", "objective": "sft", "data": ["d.jsonl"]}, command="fit", step=3,
                      total_steps=3, metrics={"train/loss": 0.5}, out=tmp_path / "final")
    assert "rlhf sft --model 'm m' --data d.jsonl" in card and "| `train/loss` | 0.5 |" in card


@pytest.mark.unit
def test_the_card_notes_an_adapter_only_from_a_readable_adapter_config(tmp_path):
    from rlhf.runtime.run.model_card import export_notes

    assert export_notes(tmp_path) == ""
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert export_notes(tmp_path) == ""  # a broken file never costs the export
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                              "base_model_name_or_path": "base"}))
    assert "This directory is a LoRA adapter (rank 8) on `base`" in export_notes(tmp_path)
