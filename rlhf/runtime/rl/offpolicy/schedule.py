"""The logical clock of ``--partial-rollouts`` and the per-token staleness bound it keeps.

Version v is the policy after v optimizer steps; batch s trains at step s. Without partial rollouts
every token of batch s comes from version ``max(first, s - K)`` (K = ``--max-staleness``). With them a
trajectory moves to newer weights as it grows, on a clock of its own policy tokens (never the wall
clock, so the versions are the same whatever the machine's load or the tools' timing):

    version(s, n) = max(first, min(cap(s), s - K + n // C))      n: the token's index among the
                                                                  trajectory's policy tokens (all turns)
    cap(s) = s - 1 for K >= 1 (s for K = 0), and at most c - 1 for every scheduled checkpoint c
             with c <= s <= c + K - 1

C = ``--partial-chunk-tokens``. ``s - 1`` keeps generation from waiting for the step that trains on
the batch itself. The checkpoint cap keeps checkpoints exact: the batches a checkpoint after step c
holds in flight (c .. c + K - 1) are then made from versions the run has before that checkpoint is
written (none needs weights trained after it). ``first`` is the first version the run has (a
resumed run's checkpoint step).

So every token of batch s has ``s - K <= version <= s``: staleness ``s - version`` at most K by
construction. `check_staleness` asserts it where batches are formed anyway (a bug, or a resume that
mixes up versions, must not train quietly) and gives the per-token ``staleness/max`` and
``staleness/mean``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.core.errors import RlhfError


class StalenessError(RlhfError):
    """A token would be trained more than K versions after the version that sampled it."""


@dataclass(frozen=True, kw_only=True)
class VersionSchedule:
    """The logical clock above, for one run: which version samples token n of batch s."""

    max_staleness: int  # K
    chunk_tokens: int  # C
    save_every: int  # 0 or -1: checkpoints only at the end
    total_steps: int
    first: int = 0  # the oldest version the run has (a resumed run's start step)

    def base(self, step: int) -> int:
        """The version of batch ``step``'s first token (every token's, without partial rollouts)."""
        return max(self.first, step - self.max_staleness)

    def cap(self, step: int) -> int:
        """The newest version batch ``step`` may sample from."""
        cap = step - 1 if self.max_staleness > 0 else step
        for checkpoint in self._checkpoints_holding(step):
            cap = min(cap, checkpoint - 1)
        return max(self.base(step), cap)

    def version(self, step: int, n: int) -> int:
        """The version that samples policy token ``n`` (0-based, all turns) of a trajectory of batch ``step``."""
        return max(self.base(step), min(self.cap(step), step - self.max_staleness + n // self.chunk_tokens))

    def next_switch(self, step: int, n: int) -> int | None:
        """The first token index after ``n`` whose version differs from token n's (None: none does)."""
        current = self.version(step, n)
        if current >= self.cap(step):
            return None
        following = (n // self.chunk_tokens + 1) * self.chunk_tokens
        while self.version(step, following) == current:  # only where `first` holds the version back
            following += self.chunk_tokens
        return following

    def _checkpoints_holding(self, step: int) -> list[int]:
        """The scheduled checkpoints c (after c steps) that hold batch ``step`` in flight: c <= step <= c + K - 1."""
        lowest = step - self.max_staleness + 1
        found = [c for c in range(max(lowest, 1), step + 1)
                 if (self.save_every > 0 and c % self.save_every == 0) or c == self.total_steps]
        return found


def check_staleness(step: int, versions: Sequence[Sequence[int]], max_staleness: int) -> dict[str, float]:
    """Assert that no token of batch ``step`` is more than ``max_staleness`` versions old; its metrics.

    ``versions``: per trajectory, the version of each policy token (in order). Raises on the first
    token over the bound, naming it."""
    total, count, worst = 0, 0, 0
    for row, tokens in enumerate(versions):
        for index, version in enumerate(tokens):
            staleness = step - version
            if staleness > max_staleness or staleness < 0:
                raise StalenessError(
                    f"staleness bound broken: policy token {index} of trajectory {row} of step {step + 1}'s batch "
                    f"was sampled by version {version}, {staleness} versions before the step that trains it "
                    f"(--max-staleness {max_staleness})")
            total, count, worst = total + staleness, count + 1, max(worst, staleness)
    return {"staleness/max": float(worst), "staleness/mean": total / count if count else 0.0}


def runs(values: Sequence[Any]) -> list[list[Any]]:
    """``values`` as [value, count] runs: [3, 3, 4] -> [[3, 2], [4, 1]] (versions; tokens.jsonl's origins too)."""
    out: list[list[Any]] = []
    for value in values:
        if out and out[-1][0] == value:
            out[-1][1] += 1
        else:
            out.append([value, 1])
    return out
