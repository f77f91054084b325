"""Metrics of a step or an eval, added up over micro-batches and ranks (both loops use these).

`WeightedMeans`: each micro-batch adds its metrics with a weight (its loss tokens in the RL loop,
its objective units in the fit loop); a metric may instead come as ``(mean, weight)``, a mean over
another population (KTO's desirable samples only, say). The result is the weighted mean of every
metric over every rank's additions. `sum_over_ranks`: plain sums (an objective's statistics).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext


class WeightedMeans:
    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, Any], weight: float = 1.0) -> None:
        """Each value a number (a tensor or float, weighted by ``weight``) or a ``(mean, weight)`` pair."""
        for key, value in metrics.items():
            mean, own_weight = value if isinstance(value, tuple) else (value, weight)
            mean = float(mean.detach()) if isinstance(mean, torch.Tensor) else float(mean)
            if own_weight > 0:
                self.sums[key] += mean * float(own_weight)
                self.weights[key] += float(own_weight)

    def result(self, dist: DistContext = SINGLE) -> dict[str, float]:
        """The weighted mean of each metric over every rank's additions (a metric of weight 0 is left out)."""
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        for rank_sums, rank_weights in dist.all_gather((dict(self.sums), dict(self.weights))):
            for key, value in rank_sums.items():
                sums[key] += value
                weights[key] += rank_weights[key]
        return {key: sums[key] / weights[key] for key in sums if weights[key] > 0}


def sum_over_ranks(values: dict[str, float] | None, dist: DistContext) -> dict[str, float]:
    """Every rank's ``values`` added up key by key (None: this rank has none)."""
    totals: dict[str, float] = defaultdict(float)
    for part in dist.all_gather(values or {}):
        for key, value in part.items():
            totals[key] += value
    return dict(totals)
