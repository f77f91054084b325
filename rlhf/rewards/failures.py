"""What a failed sample is, and the failure policy ``--reward-on-error raise|zero|fail|skip``.

A failure is data until the policy looks at it: sources record one per sample (exception, timeout,
wrong length, non-finite or non-numeric value) and keep going, so one bad sample never loses the
others' scores. ``raise`` turns the first failure into a `RewardError`; the others log the first
failure of each source once, with its traceback, and count the rest. ``zero`` scores a failure 0;
``fail`` and ``skip`` leave it without a reward (None), and the RL runtime gives the sample the
outcome ``reward_error`` (`rlhf.core.outcomes`), which ``--on-failure`` handles (``skip``: as
``mask``).
"""

from __future__ import annotations

import logging

from rlhf.core.errors import ConfigError, RlhfError
from rlhf.core.rewards import RewardFailure

logger = logging.getLogger("rlhf.rewards")


class RewardError(RlhfError):
    """A reward source failed on a sample and the policy is ``raise``."""

    def __init__(self, message: str, failure: RewardFailure | None = None):
        super().__init__(message)
        self.failure = failure


class RewardConfigError(RewardError, ConfigError):
    """A reward source cannot run at all (bad spec, missing input, unreachable setup); never a sample failure."""


def excerpt(text: object, limit: int = 120) -> str:
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def apply_policy(values: list[float | None], failures: dict[int, RewardFailure], on_error: str,
                 reported: set[str]) -> tuple[list[float | None], set[int]]:
    """Replace failed samples by the policy; return the values and the indices to drop (``fail``, ``skip``).

    ``reported`` holds the names of sources whose first failure was already logged.
    """
    if not failures:
        return values, set()
    first = failures[min(failures)]
    if on_error == "raise":
        raise RewardError(
            first.describe() + f"\n({len(failures)} sample(s) failed in this batch. Fix the reward, or pass "
            "--reward-on-error fail to end such samples with the outcome reward_error, which --on-failure handles; "
            "--reward-on-error zero|skip scores them 0 or fails them under --on-failure mask.)", first)
    if first.source not in reported:
        reported.add(first.source)
        logger.warning("%s\n(on_error=%s: failures of this source are counted in reward/failures/%s and "
                       "not printed again)", first.describe(), on_error, first.source)
    out = list(values)
    for index in failures:
        out[index] = 0.0 if on_error == "zero" else None
    return out, set(failures) if on_error in ("fail", "skip") else set()
