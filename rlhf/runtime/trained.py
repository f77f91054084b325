"""`TrainedModel`: one model being trained with its backend, as every training loop holds it
(the RL policy and critic, the fit loop's model): optimizer steps that a NaN/inf on any rank
skips on every rank, and checkpoint state.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.runtime.checkpoint import load_tensors, save_tensors


class TrainedModel:
    nonfinite_in_a_row: int  # optimizer steps skipped in a row for a NaN/inf loss or gradient

    def __init__(self, model: torch.nn.Module, backend: Any, dist: DistContext = SINGLE):
        self.model, self.backend, self.dist = model, backend, dist
        self.train_model = backend.train_module  # what training forwards call (DeepSpeed hooks its backward there)
        self.device = next(model.parameters()).device
        self.nonfinite_in_a_row = 0

    def step_metrics(self, my_loss: float, finite: bool) -> dict[str, float]:
        """Take the optimizer step; its metrics. Each rank holds a share of the step loss, and the
        metric mean runs over ranks, so the share is scaled by the world size: the mean is the sum."""
        loss = my_loss * self.dist.world_size if finite else math.nan
        return {"loss": loss, **self.apply_step(finite)}

    def apply_step(self, finite: bool) -> dict[str, float]:
        """Step the optimizer when every rank's loss was finite (``finite``, agreed over ranks), else drop the step."""
        if not finite:
            self.backend.zero_grad()
            self.nonfinite_in_a_row += 1
            return {"skipped_steps": 1.0}
        stats = self.backend.step()
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if stats["skipped"] else 0
        return {"grad_norm": stats["grad_norm"], "lr": stats["lr"], "skipped_steps": stats["skipped"]}

    # --- checkpoints ----------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write this model's state into ``directory`` (called on every rank)."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.backend.shards_state:  # every rank writes its part
            self.backend.save_checkpoint(directory)
            if self.dist.is_main:
                save_tensors({"nonfinite_in_a_row": self.nonfinite_in_a_row}, directory / "worker.pt")
        elif self.dist.is_main:  # replicated states: one copy
            save_tensors({**self.state_dict(), "nonfinite_in_a_row": self.nonfinite_in_a_row}, directory / "state.pt")

    def load(self, directory: Path) -> None:
        if self.backend.shards_state:
            self.backend.load_checkpoint(directory)
            extra = load_tensors(directory / "worker.pt")
        else:
            extra = load_tensors(directory / "state.pt")
            self.load_state_dict(extra)
        self.nonfinite_in_a_row = extra.get("nonfinite_in_a_row", 0)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "backend": self.backend.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.backend.load_state_dict(state["backend"])
