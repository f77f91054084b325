"""Evaluation during RL training (``--eval-data``): sample the eval prompts with the current policy,
score them with the run's reward sources, report ``eval/*`` metrics.

Metrics (``n`` = ``--eval-n-samples``): ``eval/reward/mean`` (mean total reward over scored
samples, before any reward shaping), ``eval/reward/<source>`` (each source's mean),
``eval/pass@n`` when n > 1 (mean over prompts of the best sample's reward: the share of prompts
solved at least once in n tries for 0/1 rewards, OpenRLHF's ``pass{n}``), ``eval/pass@1`` (mean
over prompts of the mean reward), ``eval/response/length_mean`` (policy tokens) and
``eval/response/truncated_rate``. Eval runs before the first step, every ``--eval-every`` steps
and after the last; sampling draws from the rollout's random stream, at the same points on a
resumed run, so resume stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.rewards import RewardResult
from rlhf.core.protocols.roles import RewardRole, RolloutRole
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.types import Trajectory


@dataclass(kw_only=True)
class Evaluator:
    prompts: list[Any]  # formatted eval prompt items
    n_samples: int
    every: int  # 0: only before the first step and after the last
    params: SamplingParams
    rollout: RolloutRole
    reward: RewardRole
    gather: Callable[[list[Trajectory], int, int], list[Trajectory]]  # every rank's, in prompt order
    dist: DistContext = SINGLE

    def due(self, done: int, total: int) -> bool:
        """Whether to evaluate after ``done`` completed steps (0: before training)."""
        return done == 0 or done == total or (self.every > 0 and done % self.every == 0)

    def run(self) -> dict[str, float]:
        local = self.rollout.generate(self.dist.shard(self.prompts), n=self.n_samples, params=self.params)
        trajectories = self.gather(local, len(self.prompts), self.n_samples)
        metrics = eval_metrics(trajectories, self.reward, self.n_samples) if self.dist.is_main else None
        return self.dist.broadcast(metrics) if self.dist.active else metrics


def eval_metrics(trajectories: list[Trajectory], reward: RewardRole, n_samples: int) -> dict[str, float]:
    return metrics_of(trajectories, reward.score(trajectories), n_samples)


def metrics_of(trajectories: list[Trajectory], result: RewardResult, n_samples: int) -> dict[str, float]:
    """The ``eval/*`` metrics of scored trajectories (``n_samples`` contiguous rows per prompt); ``rlhf
    eval`` reports the same."""
    metrics: dict[str, float] = {"eval/prompts": float(len(trajectories) // n_samples)}
    scored = [r for r in result.total if r is not None]
    metrics["eval/reward/mean"] = sum(scored) / len(scored) if scored else float("nan")
    for name, values in result.per_source.items():
        used = [v for v in values if v is not None]
        if used:
            metrics[f"eval/reward/{name}"] = sum(used) / len(used)
    best, mean = [], []
    for begin in range(0, len(result.total), n_samples):
        group = [r for r in result.total[begin:begin + n_samples] if r is not None]
        if group:
            best.append(max(group))
            mean.append(sum(group) / len(group))
    if mean:
        metrics["eval/pass@1"] = sum(mean) / len(mean)
        if n_samples > 1:
            metrics[f"eval/pass@{n_samples}"] = sum(best) / len(best)
    count = max(len(trajectories), 1)
    metrics["eval/response/length_mean"] = sum(t.num_policy_tokens for t in trajectories) / count
    metrics["eval/response/truncated_rate"] = sum(t.finish_reason in ("length", "budget")
                                                  for t in trajectories) / count
    return metrics
