"""The whole pipeline through the CLI: SFT -> reward model -> PPO with that reward model, whose
reward the policy then raises (the commands of examples/pipeline/run.sh, on the same toy task)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.core.plugins import build_plugin_manager
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
P = ROOT / "examples" / "pipeline"


def run(args: list[str]) -> None:
    result = run_cli(build_plugin_manager(load_entrypoints=False), args + ["--no-progress"])
    assert result.exit_code == 0, result.output


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_then_a_reward_model_then_ppo_raises_that_reward_models_reward(tmp_path):
    run(["sft", "--model", str(ROOT / "examples" / "tiny-model"), "--data", str(P / "sft.jsonl"), "--max-samples",
         "200", "--batch-size", "32", "--micro-batch-size", "16", "--epochs", "2", "--lr", "1e-4",
         "--out", str(tmp_path / "sft")])
    run(["rm", "--model", str(tmp_path / "sft" / "final"), "--data", str(P / "pairs.jsonl"), "--batch-size", "16",
         "--micro-batch-size", "16", "--lr", "5e-4", "--normalize-reward", "--out", str(tmp_path / "rm")])
    run(["train", "--algo", "ppo", "--model", str(tmp_path / "sft" / "final"), "--data",
         str(ROOT / "examples" / "data" / "train.jsonl"), "--input-key", "prompt", "--reward",
         str(tmp_path / "rm" / "final"), "--n-samples", "4", "--prompts-per-step", "16", "--max-new-tokens", "12",
         "--steps", "30", "--lr", "1e-4", "--out", str(tmp_path / "ppo")])
    rewards = [m["reward/mean"] for m in metrics(tmp_path / "ppo")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.2, rewards  # normalised rewards (std 1 over the RM training set): 0.24 -> 0.62 here
