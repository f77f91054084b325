"""`TrainedModel`: one model being trained with its backend, as every training loop holds it
(the RL policy and critic, the fit loop's model): optimizer steps that a NaN/inf on any rank
skips on every rank, and checkpoint state.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.errors import RlhfError
from rlhf.runtime.run.checkpoint import load_tensors, save_tensors
from rlhf.runtime.step.weighted_means import WeightedMeans


def forward_model(model: Any, *, packing: bool, ring: Any = None) -> Any:
    """``model`` as the loops' forwards call it: over ``ring`` when there is one
    (`rlhf.fastpaths.ring_attention.RingModel`, packed with ``packing``), else packed with ``packing``
    (`rlhf.fastpaths.packing.PackedModel`), else itself: the plain path never enters the fast paths."""
    if ring is not None:
        from rlhf.fastpaths.ring_attention import RingModel

        return RingModel(model, ring, packed=packing)
    if packing:
        from rlhf.fastpaths.packing import PackedModel

        return PackedModel(model)
    return model


def check_nonfinite_limit(skipped_in_a_row: int, limit: int, *, loss: str, check: str) -> None:
    """``--max-nonfinite-steps``: stop the run once ``limit`` optimizer steps in a row were skipped for
    a NaN/inf (every loop, every trained model). ``loss`` names it ("the policy loss"), ``check``
    says what else to look at ("the rewards")."""
    if skipped_in_a_row >= limit:
        raise RlhfError(f"{loss} or gradient was NaN/inf for {skipped_in_a_row} optimizer steps in a row (each was "
                        f"skipped); lower --lr, check {check}, or raise --max-nonfinite-steps")


class TrainedModel:
    nonfinite_in_a_row: int  # optimizer steps skipped in a row for a NaN/inf loss or gradient

    def __init__(self, model: torch.nn.Module, backend: Any, dist: DistContext = SINGLE):
        self.model, self.backend, self.dist = model, backend, dist
        self.train_model = backend.train_module  # what training forwards call (DeepSpeed hooks its backward there)
        self.device = next(model.parameters()).device
        self.nonfinite_in_a_row = 0

    def optimizer_step(self, shares: Iterable[Callable[[], tuple[torch.Tensor, dict[str, Any], float]]],
                       means: WeightedMeans) -> None:
        """One optimizer step over this rank's micro-batches, the same in every training loop.

        Each of ``shares`` computes one micro-batch's share of the step loss (normalised by the
        whole step's counts, so the shares' gradients add up to the step's), its metrics and their
        weight. Every share's backward runs, whatever happens (every rank runs all its forwards and
        backwards: they are collectives under DeepSpeed ZeRO); a share's metrics go into ``means``
        while every share so far was finite. Then the ranks agree: a NaN/inf share on any rank drops
        the step on every rank (a rank stepping alone would wait forever in the gradient all-reduce).
        ``means`` also gets the step's own metrics (weight 1): ``loss``, the step loss (every rank's
        shares summed: the mean over ranks of this rank's sum times the world size; NaN for a
        dropped step), ``grad_norm``, ``lr`` and ``skipped_steps``.
        """
        finite, my_loss = True, 0.0
        window = getattr(self.backend, "accumulating", None)  # `TrainBackendBase.accumulating`, optional
        with window() if window is not None else contextlib.nullcontext():
            for compute in shares:
                share, metrics, weight = compute()
                self.backend.backward(share)
                if not torch.isfinite(share.detach()):
                    finite = False
                elif finite:
                    my_loss += float(share.detach())
                    means.add(metrics, weight)
        finite = all(self.dist.all_gather(finite))
        loss = my_loss * self.dist.dp_size if finite else math.nan
        means.add({"loss": loss, **self.apply_step(finite)})

    def check_token_budget(self, max_tokens: int | None) -> None:
        """``--max-tokens-per-micro-batch`` gives ranks different numbers of micro-batches, and every
        forward is a collective when the backend shards the weights (ZeRO-3) over several ranks."""
        if max_tokens and self.backend.shards_weights and self.dist.active:
            raise RlhfError("--max-tokens-per-micro-batch does not work with a backend that shards the weights "
                            "(ZeRO-3) over several ranks yet; use --micro-batch-size")

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
