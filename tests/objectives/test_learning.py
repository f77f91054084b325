"""Each objective learns its toy task through the real CLI, judged on held-out data.

The toy task is the pipeline's (examples/pipeline/make_data.py): two-number addition with the
quickstart model (examples/tiny-model, which adds but rambles on after the sum). Preferred:
the bare correct sum; rejected: the sum with a restatement, or a wrong sum. Held-out rows come
from prompts no training file holds. The PRM and distillation tasks are built here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rlhf.core.plugin_host.loading import build_plugin_manager
from tests.helpers import read_jsonl, run_cli

pytestmark = pytest.mark.run

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "tiny-model"
PIPELINE = ROOT / "examples" / "pipeline"


def fit(args: list[str], out: Path) -> list[dict]:
    result = run_cli(build_plugin_manager(load_entrypoints=False), args + ["--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    return read_jsonl(out / "metrics.jsonl")


def first_and_last_eval(metrics: list[dict]) -> tuple[dict, dict]:
    evals = [m for m in metrics if "eval/loss" in m]
    return evals[0], evals[-1]


def test_sft_lowers_the_held_out_loss_and_teaches_the_model_to_stop(tmp_path):
    metrics = fit(["sft", "--model", str(MODEL), "--data", str(PIPELINE / "sft.jsonl"), "--max-samples", "256",
                   "--eval-data", str(PIPELINE / "sft_eval.jsonl"),
                   "--batch-size", "32", "--micro-batch-size", "32", "--epochs", "2", "--lr", "3e-4",
                   "--eval-every", "2"], tmp_path / "sft")
    first, last = first_and_last_eval(metrics)
    assert metrics[0]["train/loss"] > 0.3  # the base model rambles where EOS should come
    assert last["eval/loss"] < 0.5 * metrics[0]["train/loss"] and last["eval/loss"] < first["eval/loss"]


def test_a_reward_model_ranks_held_out_pairs(tmp_path):
    """Half of the rejected answers ramble (easy), half are wrong sums (the model must check the sum)."""
    metrics = fit(["rm", "--model", str(MODEL), "--data", str(PIPELINE / "pairs.jsonl"),
                   "--eval-data", str(PIPELINE / "pairs_eval.jsonl"), "--batch-size", "16", "--micro-batch-size",
                   "16", "--lr", "5e-4"], tmp_path / "rm")
    _, last = first_and_last_eval(metrics)
    assert metrics[0]["train/accuracy"] < 0.65  # a fresh head ranks about half of the pairs right
    assert last["eval/accuracy"] >= 0.7 and last["eval/margin"] > 0.5


@pytest.mark.parametrize("command, data, eval_data, extra", [
    ("dpo", "pairs.jsonl", "pairs_eval.jsonl", ["--beta", "0.1"]),
    ("kto", "kto.jsonl", "kto_eval.jsonl", ["--output-key", "completion"]),
])
def test_preference_objectives_raise_the_held_out_implicit_reward_accuracy(command, data, eval_data, extra, tmp_path):
    metrics = fit([command, "--model", str(MODEL), "--data", str(PIPELINE / data), "--max-samples", "320",
                   "--eval-data", str(PIPELINE / eval_data), "--batch-size", "32", "--micro-batch-size", "32",
                   "--lr", "1e-4", "--eval-every", "2", *extra], tmp_path / command)
    first, last = first_and_last_eval(metrics)
    assert metrics[0]["train/accuracy"] == 0.0  # policy = reference: every implicit reward is 0
    assert last["eval/accuracy"] >= 0.75 and last["eval/accuracy"] >= first["eval/accuracy"]
    assert last["eval/rejected_reward"] < first["eval/rejected_reward"] < 0


def step_chains(count: int, seed: int) -> list[dict]:
    """``w1 d1 @ w2 d2 @ w3 d3 @``: a step is good ("+") when its digit is even."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        parts, labels = [], []
        for _ in range(3):
            digit = rng.randrange(10)
            parts.append(f"{rng.choice(['add', 'carry', 'sum', 'take'])} {digit} @")
            labels.append("+" if digit % 2 == 0 else "-")
        rows.append({"input": " ".join(parts), "label": labels})
    return rows


def test_a_process_reward_model_labels_held_out_steps(tmp_path):
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step_chains(256, 0)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step_chains(64, 1)))
    metrics = fit(["prm", "--model", str(MODEL), "--data", str(tmp_path / "steps.jsonl"), "--eval-data",
                   str(tmp_path / "eval.jsonl"), "--placeholder-token", "@", "--reward-tokens", "+", "-",
                   "--batch-size", "16", "--micro-batch-size", "16", "--epochs", "2", "--lr", "1e-3"],
                  tmp_path / "prm")
    _, last = first_and_last_eval(metrics)
    assert last["eval/accuracy"] >= 0.9


def test_distillation_brings_the_student_to_the_teacher(tmp_path):
    """A random student with the quickstart model's tokenizer, distilled from that model on its task."""
    from transformers import AutoTokenizer

    from rlhf.core.plugin_host.references import import_object

    build = import_object(f"{ROOT / 'examples' / 'tiny_model.py'}:build_random_model")
    student = build(tmp_path / "student", tokenizer=AutoTokenizer.from_pretrained(MODEL))
    metrics = fit(["distill", "--model", str(student), "--teacher", str(MODEL),
                   "--data", str(PIPELINE / "sft.jsonl"), "--max-samples", "256", "--eval-data",
                   str(PIPELINE / "sft_eval.jsonl"), "--batch-size", "32",
                   "--micro-batch-size", "32", "--epochs", "2", "--lr", "3e-3", "--kd-coef", "0.5"], tmp_path / "kd")
    _, last = first_and_last_eval(metrics)
    assert last["eval/kd_loss"] < 0.5 * metrics[0]["train/kd_loss"]
