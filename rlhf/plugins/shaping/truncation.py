"""``truncation``: the stop-properly penalty (ProRL; OpenRLHF's ``--reward.stop_properly_penalty_coef``).

A completion cut by the length limit (``finish_reason == "length"``: it never produced EOS, or
its trajectory ran out of token budget) did not finish its answer. With X = ``--truncated-reward``:

    X in [0, 1]:  r ← X · r      (scale; 0 zeroes it)
    X < 0:        r ← X          (replace with a fixed penalty)

Metrics: ``truncated/count`` (samples cut) and ``truncated/rate`` (their share).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.api import ConfigError, Trajectory

TRUNCATED = ("length", "budget")  # finish reasons of a completion cut by a limit


@dataclass(kw_only=True)
class TruncationConfig:
    truncated_reward: float | None = field(default=None, metadata={
        "range": "(-inf, 1]",
        "help": "A completion cut by the length limit: X in [0, 1] scales its reward, X < 0 replaces it "
                "(OpenRLHF's stop-properly penalty)"})

    def __post_init__(self) -> None:
        if self.truncated_reward is not None and self.truncated_reward > 1:
            raise ConfigError(f"--truncated-reward must be in [0, 1] (a scale) or negative (a replacement); got "
                              f"{self.truncated_reward}")


def truncation_shaping(trajectories: list[Trajectory], rewards: list[float | None],
                       config: TruncationConfig) -> tuple[list[float | None], dict[str, float]]:
    rule = config.truncated_reward
    shaped, cut = [], 0
    for trajectory, reward in zip(trajectories, rewards):
        truncated = trajectory.finish_reason in TRUNCATED
        cut += truncated
        if reward is None or not truncated or rule is None:
            shaped.append(reward)
        else:
            shaped.append(rule if rule < 0 else reward * rule)
    return shaped, {"truncated/count": float(cut), "truncated/rate": cut / max(len(trajectories), 1)}
