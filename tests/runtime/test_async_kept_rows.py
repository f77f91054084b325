"""``--async``: a batch's behaviour log-probs are computed over every trajectory rolled out; when
failed groups leave the batch (``--on-failure retry`` / ``drop``), the rows of the trajectories it
kept are taken, in its order, at its width."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.types import Trajectory
from rlhf.runtime.rl.async_generation import kept_rows

pytestmark = pytest.mark.unit


def trajectory(length: int) -> Trajectory:
    return Trajectory(token_ids=[1] * length, loss_mask=[0] + [1] * (length - 1), prompt_length=1, prompt="p",
                      prompt_text="p", completion_text="c", group=0)


def test_the_kept_trajectories_rows_in_the_batchs_order_at_its_width():
    rolled = [trajectory(6), trajectory(3), trajectory(4), trajectory(2)]
    behaviour = torch.arange(20, dtype=torch.float32).reshape(4, 5)  # (B, A): A = 6 - 1
    kept = [rolled[2], rolled[3]]  # the first group failed and left; the widest row went with it
    assert kept_rows(behaviour, rolled, kept, 3).tolist() == [[10.0, 11.0, 12.0], [15.0, 16.0, 17.0]]
    assert torch.equal(kept_rows(behaviour, rolled, rolled, 5), behaviour)
