"""The logical clock of --partial-rollouts (each token's version by hand), the per-token staleness
checker, [version, count] runs, behaviour log-probs picked per token by version, and the policy
loss's ratio and mismatch correction reading each token's own behaviour log-prob."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlhf.core.types import Trajectory
from rlhf.runtime.rl.offpolicy.partial import behaviour_logprobs, chunk_seed, version_grid
from rlhf.runtime.rl.offpolicy.schedule import StalenessError, VersionSchedule, check_staleness, runs

pytestmark = pytest.mark.unit


def test_each_token_version_by_hand():
    # K = 2, a version step every 3 policy tokens, checkpoints after steps 4 and 10 (the end)
    schedule = VersionSchedule(max_staleness=2, chunk_tokens=3, save_every=4, total_steps=10)
    # batch 6: from version 4, then 5 (= 6 - 1, the cap) from token 3 on
    assert [schedule.version(6, n) for n in range(9)] == [4, 4, 4, 5, 5, 5, 5, 5, 5]
    assert schedule.next_switch(6, 0) == 3 and schedule.next_switch(6, 2) == 3 and schedule.next_switch(6, 3) is None
    # K = 3, C = 2, no checkpoints in the way: batch 9 from 6, 7 from token 2, 8 (the cap) from token 4
    longer = VersionSchedule(max_staleness=3, chunk_tokens=2, save_every=0, total_steps=20)
    assert [longer.version(9, n) for n in range(6)] == [6, 6, 7, 7, 8, 8]
    assert [longer.next_switch(9, n) for n in range(5)] == [2, 2, 4, 4, None]
    with pytest.raises(dataclasses.FrozenInstanceError):  # one clock for the run: nothing changes it in place
        longer.first = 3
    # batches 4 and 5 are in flight at the checkpoint after step 4: versions up to 3 only
    assert [schedule.version(5, n) for n in range(6)] == [3, 3, 3, 3, 3, 3]
    assert schedule.next_switch(5, 0) is None
    assert [schedule.version(4, n) for n in range(6)] == [2, 2, 2, 3, 3, 3]
    # the first batches start from version 0 (nothing older exists)
    assert [schedule.version(0, n) for n in range(4)] == [0, 0, 0, 0]
    assert [schedule.version(1, n) for n in range(4)] == [0, 0, 0, 0]
    # a resumed run (first version 8) never asks for older weights
    resumed = VersionSchedule(max_staleness=2, chunk_tokens=3, save_every=0, total_steps=20, first=8)
    assert resumed.version(9, 0) == 8 and resumed.version(11, 0) == 9 and resumed.version(11, 3) == 10
    # K = 0: every token from the batch's own version (the synchronous run)
    on_policy = VersionSchedule(max_staleness=0, chunk_tokens=1, save_every=0, total_steps=10)
    assert {on_policy.version(5, n) for n in range(10)} == {5} and on_policy.next_switch(5, 0) is None


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_clock_never_breaks_the_bound(k):
    for save_every in (0, 1, 2, 3):
        schedule = VersionSchedule(max_staleness=k, chunk_tokens=2, save_every=save_every, total_steps=12)
        for step in range(12):
            versions = [schedule.version(step, n) for n in range(40)]
            assert versions == sorted(versions)  # a trajectory only moves forward
            for n in range(40):  # next_switch: the first later token of another version
                switch = schedule.next_switch(step, n)
                later = [m for m in range(n + 1, 40) if versions[m] != versions[n]]
                assert switch == (later[0] if later else None) or (switch is not None and switch >= 40), (step, n)
            assert all(step - k <= v <= max(step - 1, 0) for v in versions)
            for c in range(1, 13):  # every scheduled checkpoint's in-flight batches need only weights it has
                if (save_every and c % save_every == 0) or c == 12:
                    if c <= step <= c + k - 1:
                        assert max(versions) <= c - 1


def test_the_checker_fails_on_the_first_token_over_the_bound():
    assert check_staleness(5, [[3, 4, 5], [4]], 2) == {"staleness/max": 2.0, "staleness/mean": 1.0}
    with pytest.raises(StalenessError, match="policy token 2 of trajectory 1 of step 6's batch was sampled by "
                                             "version 2, 3 versions before"):
        check_staleness(5, [[3, 4, 5], [4, 3, 2, 1]], 2)
    with pytest.raises(StalenessError, match="version 6"):  # a version the step cannot have
        check_staleness(5, [[6]], 2)
    assert check_staleness(0, [[], []], 0) == {"staleness/max": 0.0, "staleness/mean": 0.0}


def test_runs():
    assert runs([3, 3, 4, -1, -1, 4]) == [[3, 2], [4, 1], [-1, 2], [4, 1]]
    assert runs([]) == []


def test_chunk_seeds_differ_by_token_and_keep_none():
    assert chunk_seed(None, 3) is None
    assert chunk_seed(7, 3) != chunk_seed(7, 4) != chunk_seed(8, 4)
    assert chunk_seed(7, 3) == chunk_seed(7, 3) and 0 <= chunk_seed(7, 3) < 2 ** 63


def _trajectory(tokens, mask, versions):
    return Trajectory(token_ids=tokens, loss_mask=mask, prompt_length=2, prompt="p", prompt_text="p",
                      completion_text="c", group=0, token_versions=versions)


def test_behaviour_logprobs_take_each_token_from_its_own_version():
    trajectories = [_trajectory([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [-1, -1, 3, 3, 4]),
                    _trajectory([1, 2, 3, 4], [0, 0, 1, 1], None)]  # no versions recorded: the batch's (3)
    grid = version_grid(trajectories, 5, 3)  # (B, A) = (2, 4)
    assert grid.tolist() == [[-1, 3, 3, 4], [3, 3, 3, -1]]

    class Batch:
        action_mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])  # (B, A)

    per_version = {3: torch.full((2, 4), -1.0), 4: torch.full((2, 4), -2.0)}
    out = behaviour_logprobs(Batch, grid, lambda v: per_version[v])
    assert out.tolist() == [[0.0, -1.0, -1.0, -2.0], [0.0, -1.0, -1.0, 0.0]]


@pytest.mark.parametrize("correction", [None, "tis", "icepop"])
def test_the_ratio_and_the_mismatch_correction_read_each_token_own_behaviour_logprob(correction):
    from rlhf.algorithms.training_loss import per_token_policy_loss
    from rlhf.algorithms.components import load_component
    from rlhf.plugins.algorithms.policy_losses import PPOLossConfig

    loss = load_component("policy_loss", "ppo")
    config = PPOLossConfig(correction=correction)
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])  # (B, A)
    old = torch.tensor([[-1.0, -1.1, -1.5]])  # (B, A): three tokens of three versions
    rollout = torch.tensor([[-1.0, -1.2, -1.3]])  # (B, A)
    advantages, mask = torch.ones(1, 3), torch.ones(1, 3)
    mixed, _ = per_token_policy_loss(loss, config, logprobs=logprobs, old_logprobs=old, advantages=advantages,
                                     loss_mask=mask, rollout_logprobs=rollout)
    for t in range(3):  # each token's loss is the one it gets when every token had its behaviour log-prob
        alone, _ = per_token_policy_loss(loss, config, logprobs=logprobs, old_logprobs=old[:, t:t + 1].expand(1, 3),
                                         advantages=advantages, loss_mask=mask,
                                         rollout_logprobs=rollout[:, t:t + 1].expand(1, 3))
        assert mixed[0, t].item() == pytest.approx(alone[0, t].item())
    # by hand, token 1: ρ = exp(-1.0 + 1.1) clipped at 1.2 above: 1.105; w(tis) = exp(-1.1 + 1.2) in [0.5, 5]
    ratio = math.exp(0.1)
    weight = {None: 1.0, "tis": math.exp(0.1), "icepop": math.exp(0.1)}[correction]
    assert mixed[0, 1].item() == pytest.approx(-ratio * weight, rel=1e-5)


def test_partial_rollouts_need_async(tmp_path):
    from rlhf.core.errors import ConfigError
    from rlhf.runtime.config.train_config import TrainConfig

    with pytest.raises(ConfigError, match="--partial-rollouts changes how --async generates"):
        TrainConfig.from_dict(dict(model="m", data=["d.jsonl"], partial_rollouts=True, out=str(tmp_path))).derived()
    with pytest.raises(ConfigError, match="--partial-chunk-tokens must be at least 1; got 0"):
        TrainConfig.from_dict(dict(model="m", data=["d.jsonl"], async_rollout=True, partial_rollouts=True,
                                   partial_chunk_tokens=0, out=str(tmp_path))).derived()
