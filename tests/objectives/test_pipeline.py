"""The whole pipeline as the README shows it: examples/pipeline/run.sh (SFT -> reward model -> PPO with
that reward model, whose reward the policy then raises; SFT -> DPO) prints the README's figures; and
examples/pipeline/rm_check.sh (GRPO against our own reward model raises that model's reward for the
policy's greedy answers to held-out prompts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.run


ROOT = Path(__file__).resolve().parents[2]
P = ROOT / "examples" / "pipeline"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def readme_figures() -> list[str]:
    """The four lines the README says examples/pipeline/run.sh prints."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```\nsft: train loss"):]
    return block[4:block.index("```", 4)].strip().splitlines()


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", line)]


def test_the_pipeline_prints_the_readmes_figures_and_ppo_raises_the_reward_models_reward(tmp_path):
    """``bash examples/pipeline/run.sh`` as a reader runs it: SFT -> RM -> PPO with that reward model,
    and SFT -> DPO; its report is the README's, figure by figure (within float noise: the thread count
    follows the machine's load, and another CPU rounds differently: PPO's last reward 0.62 against
    the README's 0.59 on an AVX-512 Xeon), and PPO raises the reward model's reward."""
    out = tmp_path / "pipeline"
    done = subprocess.run(["bash", str(P / "run.sh"), str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "RLHF_LOAD_PLUGINS": "", "PATH": f"{Path(sys.executable).parent}:"
                                                                               f"{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.strip().splitlines()[-4:]
    expected = readme_figures()
    assert [line.split(":")[0] for line in printed] == [line.split(":")[0] for line in expected] == [
        "sft", "rm", "ppo", "dpo"]
    for got, want in zip(printed, expected):
        assert re.sub(r"\d+\.\d+", "#", got) == re.sub(r"\d+\.\d+", "#", want), (got, want)
        assert numbers(got) == pytest.approx(numbers(want), abs=0.05), (got, want)
    rewards = [m["reward/mean"] for m in metrics(out / "ppo")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.2, rewards  # normalised rewards (std 1 over the RM training set)


def test_grpo_against_our_reward_model_raises_its_reward_for_greedy_answers_to_held_out_prompts(tmp_path):
    """``bash examples/pipeline/rm_check.sh``: SFT -> reward model (``rlhf rm``) -> GRPO from the
    quickstart's base model against that reward model, 30 steps; the reward model then scores the greedy
    answers to 64 prompts of examples/data/eval.jsonl (in no stage's training data) before and after.

    The margin: over seeds 0-3 (each seeding the SFT, the reward model and GRPO) the held-out greedy
    reward went -1.60 -> 0.63, -1.66 -> 0.60, -1.47 -> 0.60, -1.64 -> 0.60 (normalised rewards: std 1
    over the reward model's training pairs), a rise of 2.07-2.26 with every one of the 64 prompts rising
    in every seed; the final figure moves by 0.03 from seed to seed. The test asks for a rise of 1.0
    (half the smallest seen, 30 times the seed-to-seed spread), 56 of 64 prompts rising, and 3 in 4
    greedy answers ending before the token budget (62-64 of 64 did: the base model rambles to the budget,
    which the reward model learned to dislike)."""
    out = tmp_path / "rm_check"
    done = subprocess.run(["bash", str(P / "rm_check.sh"), str(out), "0"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "RLHF_LOAD_PLUGINS": "", "PATH": f"{Path(sys.executable).parent}:"
                                                                               f"{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("rm check: held-out greedy reward-model reward "), line

    def greedy(name: str) -> list[dict]:
        return [json.loads(row) for row in (out / name).read_text().splitlines()]

    before, after = greedy("greedy_before.jsonl"), greedy("greedy_after.jsonl")
    assert len(before) == len(after) == 64
    assert [row["prompt"] for row in before] == [row["prompt"] for row in after]
    mean_before = sum(row["reward"] for row in before) / 64
    mean_after = sum(row["reward"] for row in after) / 64
    printed = [float(x) for x in re.findall(r"-?\d+\.\d+", line)]
    assert printed[:2] == pytest.approx([mean_before, mean_after], abs=0.006), line
    assert mean_after > mean_before + 1.0, (mean_before, mean_after)
    rose = sum(a["reward"] > b["reward"] for a, b in zip(after, before))
    assert rose >= 56, rose
    assert sum(row["finish_reason"] == "stop" for row in after) >= 48, [row["completion"] for row in after]
    assert all(row["finish_reason"] == "length" for row in before), [row["completion"] for row in before]
    rewards = [m["reward/mean"] for m in metrics(out / "grpo")]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5, rewards  # the training-sample mean rises too
