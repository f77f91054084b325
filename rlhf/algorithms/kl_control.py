"""The KL coefficient β over a run: fixed, or adapted to a target (Ziegler et al. 2019).

Ziegler et al., "Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593), §2.2, as
OpenRLHF's ``AdaptiveKLController``: after a step that measured KL ``kl`` over ``n`` samples,

    e = clip(kl / target - 1, -0.2, 0.2)
    β ← β · (1 + e · n / horizon)

so β grows while the policy is further from the reference than the target and shrinks while it
is closer, by at most 20% per ``horizon`` samples.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KLController:
    """β for the next step; ``target`` None keeps it fixed."""

    value: float  # β
    target: float | None = None
    horizon: int = 10000

    def update(self, kl: float, num_samples: int) -> None:
        """After a step whose KL to the reference was ``kl`` (mean over its ``num_samples`` samples)."""
        if self.target is None:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
