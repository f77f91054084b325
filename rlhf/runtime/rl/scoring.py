"""A rollout batch's scoring: the reward sources' call, the run's reward shapings in the order
they apply, and the sample filter's verdict on each prompt group (docs/rewards.md).

`Scoring.score` is the whole of it; a pipelined ``--async`` run calls its two halves on two
threads (`call_rewards` beside the next batch's generation, `judge` in step order). Under a
launcher the runtime wraps it (`rlhf.runtime.rl.ranks.ScoredOnMain`): it runs on the main rank,
and every rank trains on the main rank's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.core.errors import RlhfError
from rlhf.core.plugin_host.loading import PluginSet
from rlhf.core.protocols.roles import RewardRole
from rlhf.core.outcomes import TRAINED
from rlhf.core.rewards import RewardResult
from rlhf.core.types import Trajectory, groups_of
from rlhf.runtime.config.train_plan import RunPlan
from rlhf.runtime.rl.failures import mark_reward_failures


@dataclass(kw_only=True)
class Scored:
    """A scored batch: its trajectories (``reward`` shaped, None: dropped from the loss; ``rewards``
    and ``score`` per source; ``outcome`` ``reward_error`` where a source failed under ``fail`` or
    ``skip``), the sample filter's ``keep`` per prompt group (all True without a filter) and the
    reward and shaping metrics."""

    trajectories: list[Trajectory]
    keep: list[bool]
    metrics: dict[str, float]


class Scoring:
    def __init__(self, plan: RunPlan, plugins: PluginSet, reward: RewardRole):
        self.reward, self.n_samples = reward, plan.config.n_samples
        self.on_error = plan.config.reward_options.on_error
        self.sample_filter = plan.sample_filter()  # (filter, its config), or None
        self.filter_name = plan.choices["sample_filter"].name
        self.shapings = plan.reward_shapings(plugins)  # (name, shaping, its config), in order

    def score(self, trajectories: list[Trajectory]) -> Scored:
        return self.judge(trajectories, self.call_rewards(trajectories))

    def call_rewards(self, trajectories: list[Trajectory]) -> RewardResult:
        """The reward sources' (and the environment's) rewards of a batch."""
        return self.reward.score(trajectories)

    def judge(self, trajectories: list[Trajectory], result: RewardResult) -> Scored:
        """The reward sources' result written into the trajectories, shaped, and the sample
        filter's verdict per prompt group. A sample a reward source failed on ends with the outcome
        ``reward_error`` under ``--reward-on-error fail`` or ``skip``; a failed sample (any failed
        outcome) has no reward and no score from here on: shapings and the filter see None."""
        result.assign(trajectories)
        mark_reward_failures(trajectories, result, self.on_error)
        for trajectory in trajectories:
            if trajectory.outcome not in TRAINED:
                trajectory.reward = trajectory.score = None
        metrics = dict(result.metrics)
        totals: list[Any] = [t.reward for t in trajectories]
        for name, shaping, shaping_config in self.shapings:
            totals, shaping_metrics = shaping(trajectories, totals, shaping_config)
            if len(totals) != len(trajectories):
                raise RlhfError(f"reward shaping {name!r} returned {len(totals)} rewards for "
                                f"{len(trajectories)} trajectories")
            metrics.update(shaping_metrics)
        for trajectory, total in zip(trajectories, totals):
            trajectory.reward = None if total is None else float(total)
        groups = groups_of(trajectories, self.n_samples)
        keep = [True] * len(groups)
        if self.sample_filter is not None:
            sample_filter, filter_config = self.sample_filter
            keep = [bool(k) for k in sample_filter(groups, filter_config)]
            if len(keep) != len(groups):
                raise RlhfError(f"sample filter {self.filter_name!r} returned {len(keep)} flags for {len(groups)} "
                                "prompt groups")
        return Scored(trajectories=trajectories, keep=keep, metrics=metrics)
