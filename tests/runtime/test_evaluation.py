"""The one evaluation module: the schedule both loops use, and the sampled eval's batches joined
in prompt order (the RL loop's eval in one call, `rlhf eval`'s in --batch-size calls)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhf.core.rewards import RewardResult
from rlhf.runtime.run.evaluation import EvalSchedule, metrics_of, sampled

pytestmark = pytest.mark.unit


def test_the_schedule_of_the_rl_loop_and_of_the_fit_loop():
    rl = EvalSchedule(every=3, total=8, at_start=True)
    assert [done for done in range(9) if rl.due(done)] == [0, 3, 6, 8]
    fit = EvalSchedule(every=4, total=10)
    assert [done for done in range(1, 11) if fit.due(done)] == [4, 8, 10]
    assert [done for done in range(9) if EvalSchedule(every=0, total=8, at_start=True).due(done)] == [0, 8]


class Rollout:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, params):
        self.calls.append(list(prompts))
        return [SimpleNamespace(prompt=p, sample=i, num_policy_tokens=2, finish_reason="stop", reward=None,
                                rewards={}, score=None, outcome="ok") for p in prompts for i in range(n)]


class Reward:
    """Scores a sample by its prompt; source ``b`` only scores prompts >= 2 (absent from a batch without one)."""

    def score(self, trajectories):
        total = [float(t.prompt) + t.sample for t in trajectories]
        per_source = {"a": list(total)}
        if any(t.prompt >= 2 for t in trajectories):
            per_source["b"] = [1.0 if t.prompt >= 2 else None for t in trajectories]
        return RewardResult(total=total, per_source=per_source, metrics={})


def test_batches_are_sampled_in_order_and_their_scores_joined():
    rollout = Rollout()
    trajectories, result = sampled(rollout, Reward(), [0, 1, 2, 3, 4], 2, params=None, batch_size=2, assign=True)
    assert rollout.calls == [[0, 1], [2, 3], [4]]
    assert [(t.prompt, t.sample) for t in trajectories] == [(p, i) for p in range(5) for i in range(2)]
    assert result.total == [p + i for p in range(5) for i in range(2)]
    assert result.per_source["b"] == [None] * 4 + [1.0] * 6  # the first batch had no b: None there
    assert [t.reward for t in trajectories] == result.total and trajectories[0].rewards == {"a": 0.0}
    metrics = metrics_of(trajectories, result, 2)
    assert metrics["eval/reward/b"] == 1.0 and metrics["eval/prompts"] == 5.0


def test_one_call_gives_the_rewards_as_they_came():
    rollout, reward = Rollout(), Reward()
    trajectories, result = sampled(rollout, reward, [0, 3], 1, params=None)
    assert rollout.calls == [[0, 3]] and result.per_source == {"a": [0.0, 3.0], "b": [None, 1.0]}
    assert trajectories[0].reward is None  # not assigned unless asked


def test_every_step_when_every_is_one():
    assert [done for done in range(5) if EvalSchedule(every=1, total=4, at_start=True).due(done)] == [0, 1, 2, 3, 4]


def test_the_eval_metrics_by_hand():
    """Two prompts of two samples, one sample unscored: pass@1 is the mean of the prompts' mean scores,
    pass@2 the mean of their best, lengths and truncation over every sample."""
    trajectories = [SimpleNamespace(num_policy_tokens=n, finish_reason=f, outcome="ok")
                    for n, f in ((2, "stop"), (4, "length"), (6, "stop"), (8, "budget"))]
    result = RewardResult(total=[1.0, 0.0, None, 0.5], per_source={"a": [1.0, 0.0, None, 0.5]}, metrics={})
    metrics = metrics_of(trajectories, result, n_samples=2)
    assert metrics["eval/prompts"] == 2.0
    assert metrics["eval/reward/mean"] == pytest.approx(1.5 / 3)
    assert metrics["eval/reward/a"] == pytest.approx(1.5 / 3)
    assert metrics["eval/pass@1"] == pytest.approx((0.5 + 0.5) / 2)
    assert metrics["eval/pass@2"] == pytest.approx((1.0 + 0.5) / 2)
    assert metrics["eval/response/length_mean"] == pytest.approx(20 / 4)
    assert metrics["eval/response/truncated_rate"] == pytest.approx(2 / 4)
