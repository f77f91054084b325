"""Data parallelism with a launcher: two ranks give the update of one rank on the same batch,
and `torchrun -m rlhf train` runs, checkpoints and resumes with two processes (gloo on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.helpers import torchrun

pytestmark = pytest.mark.cluster

HERE = Path(__file__).parent


def test_two_ranks_update_the_policy_exactly_like_one(tiny_model_dir, tmp_path):
    script = str(HERE / "dp_fit.py")
    torchrun(1, script, str(tiny_model_dir), str(tmp_path / "one.pt"))
    torchrun(2, script, str(tiny_model_dir), str(tmp_path / "two.pt"))
    one = torch.load(tmp_path / "one.pt", weights_only=False)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    assert torch.allclose(one["old"], two["old"], atol=1e-6)  # sharded log-prob passes gather back in order
    for key, value in one["metrics"].items():  # metrics cover every rank's rows
        assert two["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, weight in one["weights"].items():  # float sums in another order: ~1e-6 apart
        assert torch.allclose(weight, two["weights"][name], atol=2e-5), name


def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(tiny_model_dir, tmp_path):
    """Row 5's NaN advantage reaches only rank 1 of 2. Both ranks must skip the two optimizer steps
    whose minibatch holds it (a rank stepping alone would wait forever in the gradient all-reduce)
    and take the other two, exactly as one rank does with the same batch."""
    script = str(HERE / "dp_fit.py")
    torchrun(1, script, str(tiny_model_dir), str(tmp_path / "one.pt"), "nan", timeout=180)
    torchrun(2, script, str(tiny_model_dir), str(tmp_path / "two.pt"), "nan", timeout=180)
    one = torch.load(tmp_path / "one.pt", weights_only=False)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    assert one["metrics"]["policy/skipped_steps"] == two["metrics"]["policy/skipped_steps"] == 0.5  # 2 of 4
    for name, weight in one["weights"].items():
        assert torch.allclose(weight, two["weights"][name], atol=2e-5), name
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.allclose(start[n], w, atol=1e-4) for n, w in two["weights"].items())  # 2 steps were taken


def test_rlhf_train_under_torchrun_with_two_processes(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8)))
    (tmp_path / "rewards.py").write_text("def reward_func(completions, **kw):\n    return [len(c) / 10 for c in completions]\n")
    args = ["-m", "rlhf", "train", "--model", str(tiny_model_dir), "--data", str(data), "--label-key", "answer",
            "--reward", str(tmp_path / "rewards.py"), "--prompts-per-step", "4", "--n-samples", "2",
            "--max-new-tokens", "4", "--micro-batch-size", "2", "--lr", "1e-3", "--no-progress",
            "--out", str(tmp_path / "run")]
    torchrun(2, *args, "--steps", "2", "--save-every", "1")
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]  # written once, by the main rank
    samples = (run / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 2 * 4 * 2  # every rank's trajectories, gathered
    assert sorted(p.name for p in (run / "checkpoints" / "step_2").iterdir()) == \
        ["MANIFEST.json", "policy", "rng_0.pt", "rng_1.pt", "trainer_state.json"]
    (run / "gen_step_2.jsonl").write_text('{"mine": 1}\n')  # a file beside the run is not the run's
    torchrun(2, *args, "--steps", "3", "--resume", "--resume-override", "steps")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert (run / "gen_step_2.jsonl").read_text() == '{"mine": 1}\n'
    assert (run / "final" / "config.json").is_file()
