"""Linear layers on a CPU through oneDNN's matrix product where torch's default runs at half speed.

torch's float32 ``F.linear`` on a CPU calls MKL's sgemm, and MKL runs its AVX2 kernels on
processors that are not Intel's even where they have AVX-512, so it runs at half the CPU's
vector width there. oneDNN, which torch also ships, picks its kernels by instruction set and runs
AVX-512: the same float32 arithmetic (equal to rounding), faster per product for training and
decoding alike.
A linear layer's three products, each as oneDNN's ``x·Wᵀ``, both operands read in place:

    forward      y  = x·Wᵀ + b          x (M, K), W (N, K), y (M, N)
    backward     ∂x = ∂y·W              = ∂y·(Wᵀ)ᵀ
                 ∂W = ∂yᵀ·x             = ∂yᵀ·(xᵀ)ᵀ
                 ∂b = Σ_rows ∂y

`use_onednn_linears` gives a model's ``nn.Linear`` layers this forward (their class becomes
`OneDnnLinear`, a subclass: weights, state dicts, LoRA wrapping and saving are unchanged). A
call takes it only where it can and pays: a float32 CPU input, no autocast, no torch.compile
tracing, not a DeepSpeed ZeRO-3 partitioned weight, and a product of at least `ONEDNN_FROM`
multiply-adds (a oneDNN call has a fixed cost above MKL's, so tiny products keep MKL); every
other call is ``nn.Linear``'s own. oneDNN builds a kernel the first time it sees a shape, then
caches it, which runs whose micro-batches all differ in token count pay a little of each step
(padding the rows up to a few fixed counts saved nothing: the copies cost as much).
``--model-adapter.cpu_linear``: ``auto`` (oneDNN where MKL does not use AVX-512: an AVX-512 CPU
not made by Intel, `onednn_pays`), ``onednn`` or ``torch``.
Measured figures: benchmarks/README.md, "oneDNN linear layers".
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.autograd.function import once_differentiable

from rlhf.core.errors import ConfigError
from rlhf.fastpaths.verdicts import settle, verdict

MODES = ("auto", "onednn", "torch")
ONEDNN_FROM = 1 << 20  # multiply-adds (M·N·K) of a product from which oneDNN beats MKL despite its call cost


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def onednn_pays() -> bool:
    """Whether this CPU runs MKL's sgemm below its width: torch's BLAS is MKL, the CPU has AVX-512
    (torch's dispatch says so) and is not Intel's, so MKL takes its AVX2 path."""
    return (onednn_available() and torch.backends.mkl.is_available()
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512") and _cpu_vendor() not in ("", "GenuineIntel"))


def onednn_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a·bᵀ (+ bias) through oneDNN: a (..., K), b (N, K), either strided as it comes; (..., N)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


class _OneDnnLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b with oneDNN's products forward and backward (the module docstring's formulas)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_product(x, weight, bias)  # (..., N)

    @staticmethod
    @once_differentiable  # a second derivative through these products is an error, not a wrong number
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])  # (M, N)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_product(grad_rows, weight.t()).view(*grad.shape[:-1], weight.shape[1])  # (..., K)
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1])  # (M, K)
            grad_weight = onednn_product(grad_rows.t(), rows.t())  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(dim=0)  # (N,)
        return grad_x, grad_weight, grad_bias


def takes_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() < 2:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    if weight.dim() != 2 or hasattr(weight, "ds_id"):  # a DeepSpeed ZeRO-3 partition: its own linear
        return False
    if x.numel() // max(x.shape[-1], 1) * weight.shape[0] * weight.shape[1] < ONEDNN_FROM:
        return False
    return not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU products of at least `ONEDNN_FROM` multiply-adds run through oneDNN.

    A layer's first oneDNN product is compared with ``F.linear``'s on the same input
    (`rlhf.fastpaths.verdicts`, path ``cpu_linear``: relative difference at most 1e-4); a layer
    that differs goes back to ``nn.Linear``, with a warning."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if not takes_onednn(x, weight, bias):
            return super().forward(x)
        if verdict(self, "cpu_linear") is None and not self._agrees(x):
            self.__class__ = nn.Linear
            return F.linear(x, weight, bias)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _OneDnnLinearFunction.apply(x, weight, bias)
        return onednn_product(x, weight, bias)  # (..., N)

    def _agrees(self, x: torch.Tensor) -> bool:
        with torch.no_grad():
            plain = F.linear(x, self.weight, self.bias)  # (..., N)
            difference = float((onednn_product(x, self.weight, self.bias) - plain).abs().max())
            scale = max(1.0, float(plain.abs().max()))
        return settle(self, "cpu_linear", difference / scale, 1e-4, who=f"oneDNN linear {tuple(self.weight.shape)}",
                      switch="--cpu-linear torch")


def check_mode(mode: str) -> None:
    """A ConfigError for a mode not in `MODES`, or ``onednn`` where this torch has no oneDNN."""
    if mode not in MODES:
        raise ConfigError(f"--cpu-linear must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "onednn" and not onednn_available():
        raise ConfigError("--cpu-linear onednn: this torch build has no oneDNN (mkldnn) CPU kernels; "
                          "use --cpu-linear auto or torch")


def use_onednn_linears(model: nn.Module, mode: str = "auto") -> int:
    """Give ``model``'s ``nn.Linear`` layers (exactly that class: quantized and adapter layers keep
    theirs) the oneDNN forward when ``mode`` asks for it (`MODES`); returns how many."""
    check_mode(mode)
    if mode == "torch" or (mode == "auto" and not onednn_pays()):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
            count += 1
    return count
