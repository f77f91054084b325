"""The ``torch`` training backend: AdamW, gradient accumulation, global-norm clipping, and a
warmup + constant/cosine LR schedule, with state that checkpoints save and restore exactly.

A backend owns one model's optimizer. The caller runs ``backward(loss)`` once per micro-batch
(each micro-batch loss is already its share of the step loss, so gradients simply add up) and
``step()`` once per optimizer step. Under data parallelism (an initialised torch.distributed
group) ``step()`` first sums the gradients of all ranks: each rank's losses are its share of the
step loss (rlhf/core/distributed.py), so the sum is the full step gradient.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from rlhf.api import TrainBackendBase, TrainStateOffload, accumulating_in_place, in_place_capable
from rlhf.plugins.backends.config import BackendConfig

__all__ = ["BackendConfig", "TorchBackend", "lr_factor"]


def lr_factor(step: int, config: BackendConfig) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    warmup = config.warmup
    if step < warmup:
        return (step + 1) / warmup
    if config.lr_scheduler == "constant":
        return 1.0
    decay_steps = max(1, config.total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


class TorchBackend(TrainBackendBase):
    """Optimizer steps for one model in this process (weights and state whole on every rank)."""

    def __init__(self, model: torch.nn.Module, config: BackendConfig):
        super().__init__(model)
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        assert self.params, "the model has no trainable parameters"
        # One fused kernel per parameter instead of a dozen ops per parameter.
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.adam_betas, eps=config.adam_eps,
                                           weight_decay=config.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, config))
        self.away = TrainStateOffload(self.optimizer, self.params)
        # the weights whose gradients may go straight into .grad (rlhf.fastpaths.in_place_gradients): this
        # backend adds nothing to a gradient as autograd hands it over; none with --no-in-place-gradients
        self.in_place = in_place_capable(self.params)

    def offload_state(self, params: bool = False) -> int:
        """The optimizer's moments and step counts, and any gradients, off the device; returns the bytes
        moved. The parameters stay (``params`` is for backends that shard them: these are whole)."""
        return self.away.offload()

    def reload_state(self) -> None:
        self.away.reload()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        return accumulating_in_place(self.in_place) if self.in_place else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if not self.in_place:
            loss.backward()
            return
        with accumulating_in_place(self.in_place):
            loss.backward()

    def step(self) -> dict[str, float]:
        """Clip, then step if the gradient is finite; always clears gradients.

        Returns ``grad_norm`` (before clipping), ``lr`` (used for this step) and ``skipped``
        (1 when a NaN/inf gradient made the step a no-op).
        """
        self._sum_gradients_over_ranks()
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    def _sum_gradients_over_ranks(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        for param in self.params:
            if param.grad is None:  # every rank must contribute every tensor
                param.grad = torch.zeros_like(param)
        grads = [param.grad for param in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The optimizer's moments and the schedule's position; the peak LR is this run's (the same
        unless a resumed run was given ``--resume-override lr``)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.base_lrs = [self.config.lr for _ in self.optimizer.param_groups]
        factor = lr_factor(self.scheduler.last_epoch, self.config)
        for group in self.optimizer.param_groups:
            group["initial_lr"], group["lr"] = self.config.lr, self.config.lr * factor
