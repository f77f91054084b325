"""``--async``, row by row: a batch's behaviour log-probs are computed over every trajectory rolled
out, and when failed groups leave the batch (``--on-failure retry`` / ``drop``) the rows of the
trajectories it kept are taken, in its order, at its width; the staleness bound is checked on the
versions the rows record (an agent's, its segments' included)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.core.types import Trajectory
from rlhf.runtime.rl.async_generation import AsyncGeneration

pytestmark = pytest.mark.unit


def trajectory(length: int) -> Trajectory:
    return Trajectory(token_ids=[1] * length, loss_mask=[0] + [1] * (length - 1), prompt_length=1, prompt="p",
                      prompt_text="p", completion_text="c", group=0)


def test_the_kept_trajectories_rows_in_the_batchs_order_at_its_width():
    rolled = [trajectory(6), trajectory(3), trajectory(4), trajectory(2)]
    behaviour = torch.arange(20, dtype=torch.float32).reshape(4, 5)  # (B, A): A = 6 - 1
    rows = {id(t): behaviour[i] for i, t in enumerate(rolled)}  # as the lanes computed them

    def kept(trajectories: list[Trajectory], width: int) -> torch.Tensor:
        prepared = SimpleNamespace(trajectories=trajectories,
                                   batch=SimpleNamespace(action_mask=torch.ones(len(trajectories), width)))
        return AsyncGeneration._kept_behaviour(SimpleNamespace(retry_lane=None), prepared, rows)

    # the first group failed and left; the widest row went with it
    assert kept([rolled[2], rolled[3]], 3).tolist() == [[10.0, 11.0, 12.0], [15.0, 16.0, 17.0]]
    assert torch.equal(kept(rolled, 5), behaviour)


def test_the_staleness_bound_is_checked_on_recorded_token_versions_segments_included():
    """An agent's trajectories record each token's version (no --partial-rollouts): where the trainer
    takes a batch, every policy token of every row, a segment's too, is within K of the step."""
    from types import SimpleNamespace

    from rlhf.runtime.rl.async_generation import AsyncGeneration
    from rlhf.runtime.rl.batches import Prepared
    from rlhf.runtime.rl.offpolicy.schedule import StalenessError

    def made(segment_version: int) -> Prepared:
        row = trajectory(3)
        row.token_versions = [-1, 2, 2]
        segment = trajectory(2)
        segment.token_versions = [-1, segment_version]
        row.segments = [segment]
        return Prepared(step=3, version=2, trajectories=[row], batch=None, reward_metrics={})

    maker = AsyncGeneration(steps=SimpleNamespace(pad_token_id=0), rollout=None, parts=None, max_staleness=1,
                            total_steps=5)
    maker.ready[3] = made(segment_version=2)
    metrics = maker.next(3).metrics
    assert metrics["staleness/max"] == 1.0 and metrics["staleness/mean"] == 1.0
    maker.ready[3] = made(segment_version=1)  # the segment's token: 2 versions before step 3
    with pytest.raises(StalenessError, match="policy token 0 of trajectory 1 of step 4's batch was sampled by "
                                             "version 1, 2 versions before"):
        maker.next(3)
