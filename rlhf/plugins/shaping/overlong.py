"""``overlong``: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4), as
OpenRLHF's ``--reward.overlong_buffer_len`` / ``--reward.overlong_penalty_factor``.

With L the buffer, c the factor and L_max = ``--max-new-tokens``, a completion of ℓ policy
tokens gets

    r ← r − c · min(ℓ − (L_max − L), L) / L      when ℓ > L_max − L

so the penalty grows linearly from 0 at L_max − L to c at L_max (and is capped at c). ℓ counts
only the tokens the policy generated: environment observations in multi-turn runs never count.
Metrics: ``overlong/penalized`` (share of samples penalised) and ``overlong/penalty_mean``
(mean penalty over all samples).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.core.settings import run_field
from rlhf.core.types import Trajectory


@dataclass(kw_only=True)
class OverlongConfig:
    buffer: int | None = run_field("overlong_buffer", None, "tokens before the limit where the penalty starts")
    factor: float = run_field("overlong_penalty_factor", 1.0, "the penalty at the limit")
    max_new_tokens: int = run_field("max_new_tokens", 256, "the generation budget per completion")


def overlong_penalty(length: int, config: OverlongConfig) -> float:
    """The (non-negative) amount taken off a completion of ``length`` policy tokens."""
    if not config.buffer:
        return 0.0
    excess = min(length - (config.max_new_tokens - config.buffer), config.buffer)
    return config.factor * excess / config.buffer if excess > 0 else 0.0


def overlong_shaping(trajectories: list[Trajectory], rewards: list[float | None],
                     config: OverlongConfig) -> tuple[list[float | None], dict[str, float]]:
    penalties = [overlong_penalty(t.num_policy_tokens, config) for t in trajectories]
    shaped = [r - p if r is not None else None for r, p in zip(rewards, penalties)]
    count = max(len(trajectories), 1)
    return shaped, {"overlong/penalized": sum(p > 0 for p in penalties) / count,
                    "overlong/penalty_mean": sum(penalties) / count}
