"""Tensors moved off their device and brought back bit for bit (``--offload-train-state``,
``--offload-ref-reward``).

A tensor on a GPU goes to pinned host memory (quick to bring back) and its device memory returns
to torch's cache, which `release_device_memory` hands back to the driver. A tensor already on
the CPU goes to a fresh copy in host memory: the move is real (its storage changes, so tests see
it) but frees nothing. Either way the values come back exactly: copies never round.

`ModuleOffload` moves a frozen model's parameters and buffers (the reference, a reward model),
`TensorOffload` any tensors (DeepSpeed's fp32 master partitions);
`TrainStateOffload` moves an optimizer's state and the gradients a backend holds between steps.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in host memory: pinned when it lives on a GPU, a fresh copy when on the CPU."""
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    out = torch.empty_like(tensor, device="cpu", pin_memory=torch.cuda.is_available())
    out.copy_(tensor.detach())
    return out


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def shares_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """True when the two modules hold a parameter in common (a view of another model, as LoRA's reference)."""
    theirs = {id(p) for p in b.parameters()}
    return any(id(p) in theirs for p in a.parameters())


def release_device_memory() -> None:
    """Return the GPU memory torch caches to the driver, so another user of the device (an engine) gets it."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Offload(abc.ABC):
    """Something moved off its device and back: ``offload`` (idempotent, returns the bytes moved),
    ``reload``, and ``in_use`` for a block that needs it on the device. Subclasses say what moves
    (`_move_out`, `_move_back`)."""

    offloaded = False

    def offload(self) -> int:
        """Move off the device; returns the bytes moved (0 when already away)."""
        if self.offloaded:
            return 0
        moved = self._move_out()
        self.offloaded = True
        release_device_memory()
        return moved

    def reload(self) -> None:
        """Bring everything back where it came from."""
        if self.offloaded:
            self._move_back()
            self.offloaded = False

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """On the device inside the block, off it before and after."""
        self.reload()
        try:
            yield
        finally:
            self.offload()

    @abc.abstractmethod
    def _move_out(self) -> int:
        """Move this kind's tensors to host memory; the bytes moved."""

    @abc.abstractmethod
    def _move_back(self) -> None:
        """Put them back on the devices they came from."""


class TensorOffload(Offload):
    """Tensors moved to host memory and back with their ``.data`` swapped, so every reference to them
    (a module, an optimizer's parameter groups) stays valid."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.tensors = list(tensors)
        self._devices: dict[int, torch.device] = {}

    def _tensors(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()
        for tensor in self.tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor

    def _move_out(self) -> int:
        moved = 0
        for tensor in self._tensors():
            self._devices[id(tensor)] = tensor.device
            tensor.data = host_copy(tensor.data)
            moved += nbytes(tensor)
        return moved

    def _move_back(self) -> None:
        for tensor in self._tensors():
            tensor.data = tensor.data.to(self._devices[id(tensor)])


class ModuleOffload(TensorOffload):
    """A module's parameters and buffers moved to host memory and back (the module object, its hooks
    and every reference to its parameters stay valid)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        super().__init__(list(module.parameters()) + list(module.buffers()))


class TrainStateOffload(Offload):
    """An optimizer's state tensors (moments, step counts, master weights: whatever ``optimizer.state``
    holds) and the gradients of ``params`` moved to host memory and back. Gradients are detached from
    their parameters while away (a parameter refuses a gradient on another device)."""

    def __init__(self, optimizer: Any, params: Iterable[torch.nn.Parameter]):
        self.optimizer, self.params = optimizer, list(params)
        self._state_devices: dict[tuple[int, str], torch.device] = {}
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor, torch.device]] = []

    def _move_out(self) -> int:
        moved = 0
        for index, state in enumerate(self.optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self._state_devices[(index, key)] = value.device
                    state[key] = host_copy(value)
                    moved += nbytes(value)
        for param in self.params:
            if param.grad is not None:
                self._grads.append((param, host_copy(param.grad), param.grad.device))
                moved += nbytes(param.grad)
                param.grad = None
        return moved

    def _move_back(self) -> None:
        for index, state in enumerate(self.optimizer.state.values()):
            for key, value in state.items():
                if (index, key) in self._state_devices:
                    state[key] = value.to(self._state_devices[(index, key)])
        for param, grad, device in self._grads:
            param.grad = grad.to(device)
        self._state_devices, self._grads = {}, []
