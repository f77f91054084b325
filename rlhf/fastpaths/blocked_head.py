"""The decode's output layer computed as W·hᵀ, a block of the vocabulary at a time.

A decode step multiplies a few rows by the whole output layer: logits = h·Wᵀ, h (B, H), W (V, H).
For that shape, few rows against a tall weight, MKL's product runs well below the rate the same
core reaches on the training's products. The same numbers come faster the other way round, the
weight as the left operand, `BLOCK` vocabulary entries at a time (each block's logits (BLOCK, B)
transposed into place while they are in cache):

    for each block b of W:   logits[:, b] = (W_b · hᵀ)ᵀ

Measured on an AMD EPYC (one thread, MKL's AVX2 kernels; benchmarks/README.md): 0.77-0.85x the
time of ``F.linear`` at Qwen2's vocabulary (151,936 x 512) with 16-48 rows, 0.68-0.79x at
32,000 x 2,048 with 16-256 rows, 0.82-0.89x at 32,000 x 256 with 16-48 rows; slower below 16
rows and no faster from 256 at the narrow sizes, so it is taken for `MIN_ROWS` to `MAX_ROWS`
rows and from `BLOCKED_FROM` weight elements. The logits had the same bits as ``F.linear``'s at
every shape measured with 12-256 rows (MKL sums each dot product in the same order either way;
at 8 rows they differ, a rounding); the lean
decoder's check against the model's forward covers the variant that uses it under a name of
its own (`rlhf.fastpaths.lean_decode`), wherever it runs.

Unlike `rlhf.fastpaths.packed_head` it holds no copy of the weight, only the decode's logits
(B, V) and a (BLOCK, B) block, allocated on the first step and written again by every step after
it: a step's logits are valid until the next step (the engines read them before they step again).
A fresh (B, V) result a step would be a fresh mapping past glibc's mmap threshold (1 MiB for a
large model, `rlhf.runtime.run.heap`), page-faulted in by the kernel each time: at Qwen2's
vocabulary and 32 rows 4,749 faults a step, and a block's copy took 194 µs into fresh pages
against 39 µs into the held ones (torch's profiler, benchmarks/README.md). It is on by default
(``--no-engine.block-head`` turns it off). Taken for a float32 weight without a bias on a CPU,
outside autocast, where the layer's own forward is MKL's product
(`rlhf.fastpaths.packed_head.head_library`); an adapter, a quantized layer or a layer taking
oneDNN keeps its own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf.fastpaths.packed_head import head_library

BLOCK = 1024  # vocabulary entries a product takes (2 MB of a 512-wide float32 weight)
BLOCKED_FROM = 1 << 22  # weight elements from which it is taken (32,000 x 256 is 8.2M)
MIN_ROWS = 16  # below this many rows it was slower (1.2x at 12)
MAX_ROWS = 128  # above, no faster at the narrow sizes measured (1.04-1.07x at 256)


class BlockedHead:
    """``head``'s forward for a decode step, as blocks of W·hᵀ."""

    def __init__(self, head: Any):
        self.head = head
        self.logits: torch.Tensor | None = None  # (B, V) every step's logits, written in place
        self.block: torch.Tensor | None = None  # (BLOCK, B)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 1, H) -> logits (B, 1, V), without gradient (decoding); overwritten by the next call."""
        weight = self.head.weight  # (V, H)
        vocab = weight.shape[0]
        with torch.no_grad():
            rows = x.reshape(-1, x.shape[-1])  # (B, H)
            transposed = rows.t().contiguous()  # (H, B)
            shape = (rows.shape[0], vocab)
            if self.logits is None or self.logits.shape != shape or self.logits.dtype != weight.dtype \
                    or self.logits.device != weight.device:
                self.logits = torch.empty(shape, dtype=weight.dtype, device=weight.device)  # (B, V)
                self.block = torch.empty((BLOCK, shape[0]), dtype=weight.dtype, device=weight.device)  # (BLOCK, B)
            logits, block = self.logits, self.block
            for first in range(0, vocab, BLOCK):
                size = min(BLOCK, vocab - first)
                torch.mm(weight[first:first + size], transposed, out=block[:size])  # (size, B)
                logits[:, first:first + size].copy_(block[:size].t())
            return logits.reshape(*x.shape[:-1], vocab)


def blocked_head(head: Any, rows: int) -> BlockedHead | None:
    """A `BlockedHead` for a decode over ``rows`` rows where it pays and can run (the module
    docstring), else None (the head's own forward runs)."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.numel() < BLOCKED_FROM or not MIN_ROWS <= rows <= MAX_ROWS:
        return None
    if getattr(head, "bias", None) is not None or head_library(head, rows) != "mkl":
        return None
    return BlockedHead(head)
