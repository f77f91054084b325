"""``overlong``: DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4), as
OpenRLHF's ``--reward.overlong_buffer_len`` / ``--reward.overlong_penalty_factor``.

With L = ``--overlong-buffer``, c = ``--overlong-penalty-factor`` and L_max = ``--max-new-tokens``
(the shaping applies when ``--overlong-buffer`` is given), a completion of ℓ policy
tokens gets

    r ← r − c · min(ℓ − (L_max − L), L) / L      when ℓ > L_max − L

so the penalty grows linearly from 0 at L_max − L to c at L_max (and is capped at c). ℓ counts
only the tokens the policy generated: environment observations in multi-turn runs never count.
Metrics: ``overlong/penalized`` (share of samples penalised) and ``overlong/penalty_mean``
(mean penalty over all samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.api import ConfigError, Trajectory, run_field


@dataclass(kw_only=True)
class OverlongConfig:
    overlong_buffer: int | None = field(default=None, metadata={
        "range": "[1, inf)",
        "help": "Overlong penalty (DAPO): a completion longer than --max-new-tokens minus this many tokens loses "
                "factor·excess/buffer (policy tokens only)"})
    overlong_penalty_factor: float = field(default=1.0, metadata={
        "range": "[0, inf)",
        "help": "The overlong penalty at its largest (a completion at the limit)"})
    max_new_tokens: int = run_field("max_new_tokens", 256, "the generation budget per completion")

    def __post_init__(self) -> None:
        if self.overlong_buffer is not None and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ConfigError(f"--overlong-buffer must be in [1, --max-new-tokens {self.max_new_tokens}]; got "
                              f"{self.overlong_buffer}")


def overlong_penalty(length: int, config: OverlongConfig) -> float:
    """The (non-negative) amount taken off a completion of ``length`` policy tokens."""
    buffer = config.overlong_buffer
    if not buffer:
        return 0.0
    excess = min(length - (config.max_new_tokens - buffer), buffer)
    return config.overlong_penalty_factor * excess / buffer if excess > 0 else 0.0


def overlong_shaping(trajectories: list[Trajectory], rewards: list[float | None],
                     config: OverlongConfig) -> tuple[list[float | None], dict[str, float]]:
    penalties = [overlong_penalty(t.num_policy_tokens, config) for t in trajectories]
    shaped = [r - p if r is not None else None for r, p in zip(rewards, penalties)]
    count = max(len(trajectories), 1)
    return shaped, {"overlong/penalized": sum(p > 0 for p in penalties) / count,
                    "overlong/penalty_mean": sum(penalties) / count}
