"""``truncation``: the stop-properly penalty (ProRL; OpenRLHF's ``--reward.stop_properly_penalty_coef``).

A completion cut by the length limit (``finish_reason == "length"``: it never produced EOS, or
its trajectory ran out of token budget) did not finish its answer. With X = ``--truncated-reward``:

    X in [0, 1]:  r ← X · r      (scale; 0 zeroes it)
    X < 0:        r ← X          (replace with a fixed penalty)

Metrics: ``truncated/count`` (samples cut) and ``truncated/rate`` (their share).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.core.settings import run_field
from rlhf.core.types import Trajectory

TRUNCATED = ("length", "budget")  # finish reasons of a completion cut by a limit


@dataclass(kw_only=True)
class TruncationConfig:
    truncated_reward: float | None = run_field("truncated_reward", None, "scale in [0, 1], or a replacement < 0")


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
