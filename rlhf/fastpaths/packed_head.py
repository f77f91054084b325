"""The decode's output layer with its weight laid out once per generation for the CPU's matrix product.

A decode step multiplies a few rows by the whole output layer: y = x·Wᵀ (+ b), x (B, H),
W (V, H). Before multiplying, the CPU libraries torch calls (MKL's sgemm by default, oneDNN under
``--cpu-linear``) copy W into the blocked layout their kernels read, on every call; with few rows
that copy is a large part of the product: at Qwen2's vocabulary (151,936 x 512) and 32 rows
MKL takes 1.16x and oneDNN 1.32x the time of the same product on a weight laid out beforehand
(1.19-1.45x over vocabularies of 32,000 and hidden sizes of 256-2,048). Both libraries take a weight laid out once (MKL's packed sgemm, oneDNN's reordered
weight), and `PackedHead` does that when a decode starts and calls the same library's product
on it at every step. The logits equal the unpacked product's to float rounding: bit for bit
through MKL at the decode shapes measured, while oneDNN may pick another kernel for a row count
other than the one the layout was made for (up to 6e-7 of the largest logit, measured). The lean
decoder's check against the model's forward covers the variant that packs under a name of its
own (`rlhf.fastpaths.lean_decode`).

It holds a copy of W while the decode runs (freed when the decode ends: nothing here refers back
to itself). A full fine-tuning run's peak is its update, where that copy is already gone (a GRPO
step at a 151,936-entry vocabulary: 0.95x the time, the same peak); a run whose peak is the decode
(LoRA, a frozen output layer) pays one copy of the output layer, so the engine takes it only when
asked (``--engine.pack-head``). Laying W out costs about three to four of the products it saves a
part of, so it is taken where it pays: at least `PACK_FROM` weight elements and `PACK_STEPS`
decode steps to hold (break-even measured at 5-25 steps over vocabularies of 32,000-151,936 and
hidden sizes of 256-2,048; benchmarks/README.md). Taken for a float32 weight on a CPU, outside autocast, where the output
layer's forward is ``nn.Linear``'s (MKL) or `OneDnnLinear`'s taking oneDNN (oneDNN); an adapter
or quantized layer keeps its own forward. The weight a decode reads is fixed for the decode; a
weight replaced or copied into meanwhile (``load_state_dict``: its storage or version counter
changes) is laid out again before the next step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlhf.fastpaths.cpu_linear import OneDnnLinear, onednn_available, takes_onednn
from rlhf.fastpaths.verdicts import verdict

PACK_FROM = 1 << 22  # 4.2M weight elements (32,000 x 256 is 8.2M): from here laying W out once pays
PACK_STEPS = 32  # decode steps from which it pays (break-even measured at 5-25)


def _mkl_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def head_library(head: nn.Module, rows: int) -> str | None:
    """"mkl" or "onednn": the library ``head``'s own forward uses for a decode of ``rows`` rows, or
    None where it is neither (an adapter, a quantized layer) or the layer does not qualify."""
    forward = getattr(type(head), "_layer_forward", type(head).forward)  # a vocab-chunked head's own
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or hasattr(weight, "ds_id"):
        return None
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return None
    if torch.is_autocast_enabled("cpu"):
        return None
    sample = weight.new_empty((rows, 1, weight.shape[1]))  # (B, 1, H) what a step passes
    if forward is OneDnnLinear.forward and verdict(head, "cpu_linear") is not False \
            and takes_onednn(sample, weight, bias):
        return "onednn" if onednn_available() else None
    if forward is nn.Linear.forward or forward is OneDnnLinear.forward:
        return "mkl" if _mkl_available() else None
    return None


class PackedHead:
    """``head``'s forward for ``rows`` rows at a time, its weight laid out once for ``library``."""

    def __init__(self, head: nn.Linear, rows: int, library: str):
        self.head, self.rows, self.library = head, rows, library
        self.packed: torch.Tensor | None = None
        self.packed_from: tuple[int, int] | None = None  # (storage address, version) of the weight packed
        # No reference back to itself (a bound method kept as an attribute): the copy must go with the
        # decode, not wait for the cyclic garbage collector while the update runs.

    def _pack(self) -> None:
        weight = self.head.weight
        if self.library == "mkl":
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, self.rows)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.rows)
        self.packed_from = (weight.data_ptr(), weight._version)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 1, H) -> logits (B, 1, V), without gradient (decoding)."""
        weight, bias = self.head.weight, self.head.bias
        with torch.no_grad():
            if self.packed_from != (weight.data_ptr(), weight._version):
                self._pack()
            x = x.contiguous()
            if self.library == "mkl":
                return torch.ops.mkl._mkl_linear(x, self.packed, weight, bias, self.rows)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def packed_head(head: Any, rows: int, steps: int) -> PackedHead | None:
    """A `PackedHead` for a decode of ``steps`` steps over ``rows`` rows where it pays and can
    run (the module docstring), else None (the head's own forward runs)."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.numel() < PACK_FROM or steps < PACK_STEPS or rows < 1:
        return None
    library = head_library(head, rows)
    return PackedHead(head, rows, library) if library is not None else None
