"""What scoring a batch gives, as the trainer and any reward role see it: `RewardResult` (the
total per sample, each source's scores, metrics) and `RewardFailure` (one sample a source could
not score). The machinery that produces them is `rlhf.rewards`; these are the shared data types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf.core.types import Trajectory


@dataclass
class RewardFailure:
    """One sample that a source could not score."""

    source: str  # the source's metric name
    where: str  # function with its file or module, URL, or model directory
    index: int  # sample index in the scored batch
    reason: str  # "exception", "timeout", "wrong length", "not finite", "bad value", "http"
    message: str  # one line
    prompt: str = ""  # excerpt of the sample's prompt
    traceback: str = ""  # the original traceback text, when there was an exception

    def describe(self) -> str:
        text = (f"reward {self.source!r} ({self.where}) failed on sample {self.index} ({self.reason}): "
                f"{self.message}\n  prompt: {self.prompt!r}")
        if self.traceback:
            text += "\n" + self.traceback.rstrip()
        return text



@dataclass
class RewardResult:
    """Rewards of one batch: the total per sample, each source's scores, and metrics."""

    total: list[float | None]  # weighted sum; None = drop the sample from the loss
    per_source: dict[str, list[float | None]]  # after the policy: failures are 0 (zero) or None (skip)
    metrics: dict[str, float]
    scores: dict[str, list[float | None]] = field(default_factory=dict)  # OpenRLHF `scores`, by source
    first_error: RewardFailure | None = None  # the first failure of this call, if any
    # Per sample, when a source gave `scores`: the weighted sum of each source's score (its reward
    # where it gave none). Empty: the scores are the totals.
    combined_scores: list[float | None] = field(default_factory=list)
    # Sample index -> the first line of its first failure, for every sample a source failed on
    # (whatever the policy did with it; under ``fail`` and ``skip`` its total is None).
    errors: dict[int, str] = field(default_factory=dict)

    def assign(self, trajectories: Sequence[Trajectory]) -> None:
        """Write ``reward``, ``rewards`` (per source) and ``score`` into the trajectories."""
        assert len(trajectories) == len(self.total), f"{len(trajectories)} trajectories, {len(self.total)} rewards"
        for i, trajectory in enumerate(trajectories):
            trajectory.reward = self.total[i]
            trajectory.rewards = {name: values[i] for name, values in self.per_source.items()}
            trajectory.score = self.combined_scores[i] if self.combined_scores else self.total[i]
