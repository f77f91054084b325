"""OpenRLHF's README examples (SFT, reward model, PPO) run as OpenRLHF users type them, translated
only by rlhf's aliases of OpenRLHF's flag names (issue 53), on the tiny model.

Substituted: the model and the data paths (and the data's column names), the sizes (batch sizes,
lengths, sample counts) that make them run in seconds on a CPU. Left out, each for a reason the
test machine has: ``--flash_attn`` (CUDA), ``--zero_stage`` (DeepSpeed's processes: the cluster
tier), ``--use_wandb`` (a W&B account), and the Ray placement and vLLM flags of the PPO example (its
command line is parsed whole in test_openrlhf_names.py). The PPO example runs on the local runtime
with OpenRLHF's default estimator named (``--advantage_estimator gae``: rlhf's default is GRPO), and
the reward model is trained with ``--normalize_reward`` because the PPO example asks for it.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, run_cli

pytestmark = pytest.mark.run

MODEL = str(ROOT / "examples" / "tiny-model")
PIPELINE = ROOT / "examples" / "pipeline"


def _steps(run) -> int:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return max(row.get("step", 0) for row in rows)


def test_openrlhfs_sft_rm_and_ppo_examples_run_with_their_own_flag_names(plugins, tmp_path):
    sft = run_cli(plugins, [
        "sft", "--max_len", "64", "--dataset", str(PIPELINE / "sft.jsonl"), "--input_key", "prompt",
        "--output_key", "response", "--input_template", "User: {}\nAssistant: ", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--max_samples", "32", "--pretrain", MODEL,
        "--save_path", str(tmp_path / "sft"), "--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1",
        "--max_epochs", "1", "--bf16", "--packing_samples", "--learning_rate", "5e-6", "--gradient_checkpointing",
        "--no-progress"])
    assert sft.exit_code == 0, sft.output
    assert "note: --pretrain is --model in rlhf" in sft.output and "--save_steps -1 is --save-every 0" in sft.output
    assert (tmp_path / "sft" / "final" / "config.json").is_file() and _steps(tmp_path / "sft") == 4
    # OpenRLHF's --save_steps -1 (no checkpoint along the way) is rlhf's --save-every 0: one, at the end
    assert sorted(p.name for p in (tmp_path / "sft" / "checkpoints").iterdir()) == ["step_4"]

    rm = run_cli(plugins, [
        "rm", "--save_path", str(tmp_path / "rm"), "--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1",
        "--train_batch_size", "8", "--micro_train_batch_size", "4", "--pretrain", str(tmp_path / "sft" / "final"),
        "--bf16", "--max_epochs", "1", "--max_len", "64", "--learning_rate", "9e-6",
        "--dataset", str(PIPELINE / "pairs.jsonl"), "--max_samples", "32", "--apply_chat_template",
        "--chosen_key", "chosen", "--rejected_key", "rejected", "--packing_samples", "--gradient_checkpointing",
        "--normalize_reward", "--no-progress"])
    assert rm.exit_code == 0, rm.output
    assert (tmp_path / "rm" / "final" / "config.json").is_file() and _steps(tmp_path / "rm") == 4

    ppo = run_cli(plugins, [
        "train", "--pretrain", str(tmp_path / "sft" / "final"), "--reward_pretrain", str(tmp_path / "rm" / "final"),
        "--save_path", str(tmp_path / "ppo"), "--micro_train_batch_size", "2", "--train_batch_size", "4",
        "--micro_rollout_batch_size", "4", "--rollout_batch_size", "4", "--n_samples_per_prompt", "1",
        "--max_samples", "8", "--max_epochs", "1", "--prompt_max_len", "64", "--generate_max_len", "8", "--bf16",
        "--actor_learning_rate", "5e-7", "--critic_learning_rate", "9e-6", "--init_kl_coef", "0.01",
        "--prompt_data", str(ROOT / "examples" / "data" / "train.jsonl"), "--input_key", "prompt",
        "--apply_chat_template", "--normalize_reward", "--gradient_checkpointing", "--packing_samples",
        "--advantage_estimator", "gae", "--no-progress"])
    assert ppo.exit_code == 0, ppo.output
    assert _steps(tmp_path / "ppo") == 2  # one pass over 8 prompts, 4 a step (OpenRLHF's --num_episodes 1)
    last = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()][-1]
    assert "critic/loss" in last and last["critic/lr"] == 9e-6  # PPO with a critic, as OpenRLHF's example
    assert (tmp_path / "ppo" / "final" / "config.json").is_file()
