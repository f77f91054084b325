"""The default environment: one model turn, then the episode ends.

The completion is scored by the reward sources alone (the env adds reward 0). This is what a
run without ``--env`` does; it exists as a class so the rollout loop has a single code path.
"""

from __future__ import annotations

from typing import Any

from rlhf.api import StepResult


class SingleTurnEnv:
    """One model turn; the reward comes from the reward sources."""

    stop = None
    blocking = False  # nothing to wait for: reset and step run inline, not in a worker thread

    def reset(self, prompt: Any, label: Any, **columns: Any) -> None:
        return None

    def step(self, action_text: str) -> StepResult:
        return StepResult(done=True)
