"""Typed outcomes (rlhf.core.outcomes) and what each estimator does with a masked failure: its
baseline taken over the group's other samples, its own advantage 0 (docs/outcomes.md)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf import api
from rlhf.core.errors import RlhfError
from rlhf.core.outcomes import (FAILURES, OUTCOMES, TRAINED, error_line, fail_trajectory, outcome_of_finish, trains)
from rlhf.core.types import AdvantageConfig, AdvantageInputs, Trajectory
from rlhf.plugins.algorithms.grpo import dr_grpo_advantages, grpo_advantages
from rlhf.plugins.algorithms.reinforce import reinforce_pp_baseline_advantages
from rlhf.plugins.algorithms.rloo import rloo_advantages

pytestmark = pytest.mark.unit


def trajectory(**changes) -> Trajectory:
    values = dict(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], prompt_length=1, prompt="p", prompt_text="p",
                  completion_text="ab", group=0)
    return Trajectory(**{**values, **changes})


def test_the_outcomes_and_which_train():
    assert list(OUTCOMES) == ["ok", "truncated", "env_error", "reward_error", "tool_timeout", "agent_error", "timeout",
                              "stale", "drift"]
    assert TRAINED == {"ok", "truncated"}
    assert FAILURES == ("env_error", "reward_error", "tool_timeout", "agent_error", "timeout", "stale", "drift")
    assert [trains(name) for name in OUTCOMES] == [True, True] + [False] * 7
    assert trajectory().outcome == "ok" and trajectory().error is None  # the shared contract's defaults


def test_finish_reasons_of_a_limit_are_truncated():
    assert [outcome_of_finish(r) for r in ("stop", "length", "budget", "max_turns", "eos")] == \
        ["ok", "truncated", "truncated", "truncated", "ok"]


def test_a_failure_keeps_its_first_line_with_the_exceptions_type():
    assert error_line(ValueError("tool crashed\n  at line 3")) == "ValueError: tool crashed"
    assert error_line(TimeoutError()) == "TimeoutError"
    assert error_line(KeyError("x")) == "KeyError: 'x'"
    assert error_line(RlhfError("the reward failed\nmore")) == "the reward failed"  # rlhf's own speak for themselves
    assert error_line("first\nsecond") == "first" and error_line("") == ""
    failed = fail_trajectory(trajectory(), "env_error", RuntimeError("boom\ntrace"))
    assert (failed.outcome, failed.error) == ("env_error", "RuntimeError: boom")
    with pytest.raises(ValueError, match="'ok' is not a failed outcome"):
        fail_trajectory(trajectory(), "ok", "x")
    with pytest.raises(ValueError, match="'crashed' is not a failed outcome"):
        fail_trajectory(trajectory(), "crashed", "x")


def test_a_plugin_reaches_them_through_the_api():
    assert api.OUTCOMES is OUTCOMES and api.TRAINED is TRAINED and api.fail_trajectory is fail_trajectory
    assert api.error_line is error_line and api.outcome_of_finish is outcome_of_finish and api.FAILURES is FAILURES


# --- mask: the estimators' baselines over the successful samples ---------------------------------

# One group of four samples, one action token each; sample 3 failed (its reward a stand-in that
# must not count), then a whole group of two.
REWARDS = [1.0, 0.0, 3.0, 100.0, 2.0, 4.0]
VALID = [True, True, True, False, True, True]


def masked_inputs(rewards=REWARDS, valid=VALID, n=None) -> AdvantageInputs:
    rewards_t = torch.tensor(rewards)
    return AdvantageInputs(rewards=rewards_t, action_mask=torch.ones(len(rewards), 1), group_size=n or 2,
                           sample_mask=torch.tensor(valid))


def first_group(estimator, n=4) -> list[float]:
    advantages, _ = estimator(masked_inputs(REWARDS[:4], VALID[:4], n=n), AdvantageConfig())
    return advantages[:, 0].tolist()


def test_grpo_under_mask_normalises_by_the_others_mean_and_unbiased_std():
    mean, std = 4 / 3, math.sqrt(((1 - 4 / 3) ** 2 + (4 / 3) ** 2 + (3 - 4 / 3) ** 2) / 2)  # over 1, 0, 3
    assert std == pytest.approx(math.sqrt(7 / 3))
    expected = [(1 - mean) / std, (0 - mean) / std, (3 - mean) / std, 0.0]
    assert first_group(grpo_advantages) == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_under_mask_subtracts_the_others_mean():
    assert first_group(dr_grpo_advantages) == pytest.approx([-1 / 3, -4 / 3, 5 / 3, 0.0], abs=1e-6)


def test_rloo_under_mask_leaves_one_out_of_the_successful_samples():
    # r_i - mean of the other successful samples: 1 - (0 + 3)/2, 0 - (1 + 3)/2, 3 - (1 + 0)/2
    assert first_group(rloo_advantages) == pytest.approx([-0.5, -2.0, 2.5, 0.0], abs=1e-6)


def test_reinforce_pp_baseline_under_mask_whitens_over_the_successful_samples_only():
    shaped = [-1 / 3, -4 / 3, 5 / 3]  # r - mean(1, 0, 3): mean 0 over the three tokens
    std = math.sqrt(sum(s * s for s in shaped) / 3)  # token-weighted, as the whitening is
    expected = [s / std for s in shaped] + [0.0]
    assert first_group(reinforce_pp_baseline_advantages) == pytest.approx(expected, abs=1e-5)


def test_a_masked_sample_changes_nothing_else_in_the_batch():
    """The failed sample's stand-in reward (100) moves no other sample's advantage: the same batch
    with any other stand-in gives the same advantages."""
    for estimator in (grpo_advantages, dr_grpo_advantages, rloo_advantages, reinforce_pp_baseline_advantages):
        got, _ = estimator(masked_inputs(), AdvantageConfig())
        other, _ = estimator(masked_inputs([*REWARDS[:3], -7.0, *REWARDS[4:]]), AdvantageConfig())
        assert torch.equal(got, other) and got[3, 0] == 0


def test_the_built_in_estimators_declare_they_support_masking(plugins):
    registry = plugins.registry("advantage_estimator")
    for name in ("gae", "reinforce_pp", "reinforce_pp_baseline", "rloo", "grpo", "dr_grpo"):
        assert registry.component(name).capabilities["supports_masking"] is True, name
