"""``--ring-attn-size 2`` with DeepSpeed: its gradient average over every rank, times the world size
(the backend's loss scaling), is the sum of the ring ranks' shares, so two processes in one ring
update the policy as one process does, under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import torchrun

HERE = Path(__file__).parent
pytestmark = [pytest.mark.cluster, pytest.mark.deepspeed]


def test_a_ring_of_two_updates_like_one_process_under_zero2_and_zero3(tiny_model_dir, tmp_path):
    script = str(HERE / "ring_fit_ds.py")
    torchrun(1, script, str(tiny_model_dir), str(tmp_path / "one.pt"), "1", timeout=400)
    torchrun(2, script, str(tiny_model_dir), str(tmp_path / "ring.pt"), "2", timeout=400)
    one = torch.load(tmp_path / "one.pt", weights_only=False)
    ring = torch.load(tmp_path / "ring.pt", weights_only=False)
    for stage in (2, 3):
        assert one[stage]["metrics"]["policy/grad_norm"] > 0
        for key, value in one[stage]["metrics"].items():
            assert ring[stage]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (stage, key)
        # Adam at lr 1e-2 divides by the gradient's size, so where a gradient is nearly 0 the
        # reduction's rounding shows in that element's update (5.3e-5 on one of 16,384 elements on an
        # AVX-512 CPU): each element within lr / 20, each tensor's mean within lr / 4,000 (a missing,
        # doubled or stale update moves every element by about lr). A wrong share or scale fails the
        # metrics above, grad_norm to 1e-5.
        for name, weight in one[stage]["weights"].items():
            difference = (ring[stage]["weights"][name].float() - weight.float()).abs()
            assert float(difference.max()) <= 5e-4 and float(difference.mean()) <= 2.5e-6, \
                (stage, name, float(difference.max()), float(difference.mean()))
