"""``--ring-attn-size 2`` under two processes takes the one-process step: sft, dpo, kto, rm (the fit
loop's step) and the RL policy update, padded and packed, and prm and distill padded; and ``rlhf train`` end to end under
torchrun logs the one-process run's losses and gradient norms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf.core.distributed import SINGLE
from tests.fastpaths.ring_fit import CASES, take_step
from tests.helpers import torchrun

pytestmark = pytest.mark.cluster

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def ring_steps(tiny_model_dir, fit_data, fit_teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("ring-fit") / "steps.pt"
    torchrun(2, str(HERE / "ring_fit.py"), str(tiny_model_dir), str(fit_data), str(fit_teacher), str(out), cwd=ROOT,
             timeout=400)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("command,packing", CASES)
def test_a_ring_of_two_takes_the_one_process_step(command, packing, ring_steps, tiny_model_dir, fit_data, fit_teacher,
                                                  tmp_path):
    """The step's loss and gradient (every rank's summed, as the backends do) equal one process's
    to 1e-5 relative; for RL the old log-probs too."""
    got = ring_steps[f"{command}/{'packed' if packing else 'padded'}"]
    expected = take_step(command, packing, str(tiny_model_dir), str(fit_data), str(fit_teacher), tmp_path / "one",
                         SINGLE)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
    assert got["grads"].keys() == expected["grads"].keys()
    scale = max(float(g.abs().max()) for g in expected["grads"].values())
    assert scale > 1e-3, "a zero gradient checks nothing"
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    if command == "rl":
        torch.testing.assert_close(got["old"], expected["old"], rtol=1e-5, atol=1e-5)


def test_rlhf_train_with_a_ring_logs_the_one_process_run(tiny_model_dir, task, tmp_path):
    """Two steps of GRPO with --packing: under torchrun with --ring-attn-size 2 (one data-parallel
    rank, each sequence split over two) the policy's loss and gradient norm are the one-process
    run's, and the runs end with the same weights."""
    args = ["-m", "rlhf", "train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
            "--label-key", "answer", "--reward", str(task / "rewards.py"), "--prompts-per-step", "2",
            "--n-samples", "2", "--max-new-tokens", "6", "--micro-batch-size", "2", "--steps", "2", "--lr", "1e-3",
            "--seed", "7", "--packing", "--no-progress"]
    torchrun(1, *args, "--out", str(tmp_path / "one"), cwd=ROOT, timeout=300)
    torchrun(2, *args, "--ring-attn-size", "2", "--out", str(tmp_path / "ring"), cwd=ROOT, timeout=300)
    runs = [[json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("one", "ring")]
    assert [m["step"] for m in runs[1]] == [1, 2]
    for one, ring in zip(*runs):
        for key in ("policy/loss", "policy/grad_norm", "reward/mean"):
            assert ring[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
        assert one["policy/grad_norm"] > 0
    from safetensors.torch import load_file

    one, ring = (load_file(str(tmp_path / name / "final" / "model.safetensors")) for name in ("one", "ring"))
    for name, weight in one.items():
        torch.testing.assert_close(ring[name], weight, rtol=1e-4, atol=1e-5, msg=name)
