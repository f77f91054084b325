"""Data-parallel ranks kept out of the loop: the roles share a batch's prompts out and agree on its
scores, so that the trainer and its batch making read as one process (docs/architecture.md).

Under a launcher (torchrun) every rank runs the loop and draws the same prompts; the runtime
(rlhf/runtime/rl/local.py) wraps its roles:

* `RankedRollout`: takes the whole prompt list, generates this rank's share (prompts ``r, r + D,
  ...``, `DistContext.shard`) and returns every rank's trajectories in prompt order;
* `ScoredOnMain`: ``score`` runs on the main rank only and every rank gets its answer: the reward
  sources (eval) and the batch's scoring with its shaping and sample filter
  (`rlhf.runtime.rl.scoring.Scoring`), whose plugins and ``on_rollout_end`` edits are the main
  rank's;
* a generate call's prompts come in multiples of the data-parallel ranks (``prompt_multiple``),
  so that every rank generates the same number (``on_ranks`` gives the loop all of these).

The Ray runtime shares prompts out over its rollout actors the same way
(`rlhf.runtime.ray.groups.RolloutGroup`); both put the trajectories back together with `regroup`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.core.distributed import DistContext, unshard
from rlhf.core.protocols.roles import RolloutRole
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.types import Trajectory, groups_of, number_groups

if TYPE_CHECKING:
    from rlhf.runtime.rl.trainer import Workers


def on_ranks(workers: Workers) -> Workers:
    """The roles one rank's loop drives under a launcher (``workers.dist`` active)."""
    dist = workers.dist
    return dataclasses.replace(workers, rollout=RankedRollout(workers.rollout, dist),
                               reward=ScoredOnMain(workers.reward, dist), scoring=ScoredOnMain(workers.scoring, dist),
                               prompt_multiple=dist.dp_size)


def regroup(shards: list[list[Trajectory]], n: int, num_prompts: int) -> list[Trajectory]:
    """The trajectories of a prompt list generated in shards (shard r: prompts ``r, r + W, ...``,
    ``n`` contiguous samples each) in prompt order, groups numbered over the whole list."""
    groups = unshard([groups_of(shard, n) for shard in shards])  # prompt p came from shard p % W
    assert len(groups) == num_prompts, f"{len(groups)} prompt groups came back for {num_prompts} prompts"
    return number_groups(groups)


class RankedRollout:
    """One rank's rollout role under a launcher (`RolloutRole`): every rank passes the same prompts."""

    def __init__(self, rollout: RolloutRole, dist: DistContext):
        self.rollout, self.dist = rollout, dist
        self.stateful = rollout.stateful

    def generate(self, prompts: list[Any], *, n: int, params: SamplingParams) -> list[Trajectory]:
        mine = self.rollout.generate(self.dist.shard(prompts), n=n, params=params)
        return regroup(self.dist.all_gather(mine), n, len(prompts))

    def sync_weights(self) -> None:
        self.rollout.sync_weights()

    def save(self, directory: Path) -> None:
        self.rollout.save(directory)

    def load(self, directory: Path) -> None:
        self.rollout.load(directory)


class ScoredOnMain:
    """``scorer.score`` on the main rank; every rank gets its answer. ``scorer`` is None on the
    other ranks where only the main rank builds it."""

    def __init__(self, scorer: Any, dist: DistContext):
        self.scorer, self.dist = scorer, dist

    def score(self, trajectories: list[Trajectory]) -> Any:
        return self.dist.broadcast(self.scorer.score(trajectories) if self.dist.is_main else None)
