"""``dynamic``: DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2), as OpenRLHF's
``--algo.dynamic_filtering_enable``.

A prompt group whose samples all score the same teaches nothing to a group estimator (GRPO,
RLOO, ...: every advantage is 0) and only dilutes the step. The filter drops

- a group whose scores do not vary (max = min over its scored samples), and
- with ``filter_range = (lo, hi)``, a group whose mean score is not strictly inside (lo, hi)
  (OpenRLHF keeps ``lo < mean < hi``; with 0/1 scores and (0, 1) that is "some but not all").

A sample's score is what its reward functions returned as OpenRLHF ``scores`` (e.g. accuracy,
while the reward may carry format bonuses), else its reward before shaping. Samples whose
reward was dropped (None) do not count; a group with fewer than two scored samples is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.api import ConfigError, Trajectory


@dataclass(kw_only=True)
class DynamicFilterConfig:
    filter_range: tuple[float, float] | None = field(default=None, metadata={
        "range": "(-inf, inf)",
        "help": "LO HI: keep a group only when its mean score lies strictly between LO and HI (OpenRLHF's "
                "dynamic filtering range)", "nargs": 2})

    def __post_init__(self) -> None:
        if self.filter_range is not None and not self.filter_range[0] < self.filter_range[1]:
            raise ConfigError(f"--filter-range needs LO < HI; got {list(self.filter_range)}")


def keeps_group(scores: list[float], filter_range: tuple[float, float] | None) -> bool:
    """Whether a group with these scores is kept (see the module docstring)."""
    if len(scores) < 2 or max(scores) == min(scores):
        return False
    if filter_range is not None:
        low, high = filter_range
        return low < sum(scores) / len(scores) < high
    return True


def dynamic_filter(groups: list[list[Trajectory]], config: DynamicFilterConfig | None) -> list[bool]:
    """One keep flag per prompt group: its scores vary (and their mean is inside the range)."""
    filter_range = config.filter_range if config is not None else None
    return [keeps_group([t.score for t in group if t.score is not None and t.reward is not None], filter_range)
            for group in groups]
