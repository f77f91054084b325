"""Settings of the ``ppo`` and ``gspo`` policy losses (``ppo_loss.py``, ``gspo_loss.py``); no torch here,
the command line reads them.

Each is ``--policy-loss.<name>`` (``--clip-low``, ``--clip-high``, ``--dual-clip`` for short) or
``--algo-config <name>=VALUE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.api import RlhfError

CORRECTIONS = ("tis", "icepop", "seq_mask_tis")  # rollout/trainer mismatch corrections (mismatch.py)


@dataclass(kw_only=True)
class PPOLossConfig:
    """Settings of the ``ppo`` and ``gspo`` policy losses."""

    clip_low: float = field(default=0.2, metadata={"help": "ε_low: the ratio is clipped below at 1 - ε_low"})
    clip_high: float = field(default=0.2, metadata={
        "help": "ε_high: the ratio is clipped above at 1 + ε_high (larger than ε_low: DAPO's clip-higher)"})
    dual_clip: float | None = field(default=None, metadata={
        "help": "c > 1: for negative advantages the loss is at most -c·Â (dual-clip PPO); None: off"})
    correction: str | None = field(default=None, metadata={
        "help": "rollout/trainer mismatch correction: 'tis' (clamped weight), 'icepop' (weight 0 "
                "outside the bounds) or 'seq_mask_tis' (drop a sequence whose geometric-mean weight leaves "
                "the bounds); needs the rollout engine's log-probs; None: off"})
    correction_bounds: tuple[float, float] = field(default=(0.5, 5.0), metadata={
        "help": "[lo, hi] for the correction weight exp(logp_old - logp_rollout)"})

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1 or not self.clip_high >= 0:
            raise RlhfError(f"ppo clip ranges need 0 <= clip_low < 1 and clip_high >= 0, "
                            f"got clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise RlhfError(f"dual_clip must be greater than 1 (or None to turn it off), got {self.dual_clip}")
        if isinstance(self.correction, str):
            self.correction = self.correction.replace("-", "_")  # OpenRLHF spells it seq-mask-tis
        if self.correction is not None and self.correction not in CORRECTIONS:
            raise RlhfError(f"unknown mismatch correction {self.correction!r}; choose one of "
                            f"{', '.join(CORRECTIONS)} (or None)")
        low, high = self.correction_bounds
        if not 0 <= low <= high:
            raise RlhfError(f"correction_bounds must satisfy 0 <= lo <= hi, got {self.correction_bounds}")
