"""Drawing one token per row from a distribution on a CPU: inverse CDF, in two levels at large vocabularies.

A row's token is the first v whose cumulative probability exceeds u·total, u ~ U[0, 1) one float32
uniform per row: token v is drawn when u·total falls in [C(v−1), C(v)), C(v) = p_0 + ... + p_v, an
interval as long as p_v (to the uniform's 2⁻²⁴ resolution). ``torch.multinomial`` draws an
exponential per vocabulary entry on a CPU instead, which costs more than a small model's forward.

The plain way is one cumulative sum over the vocabulary (``probs.cumsum``, accumulated in float64,
each value rounded once to float32). It walks every entry one by one: at Qwen2's vocabulary
(151,936) and 32 rows 5.2 ms a token, more than the softmax before it (3.3 ms), and 13 ms inside a
decode, where the rows come from memory. From `TWO_LEVEL_FROM` entries it goes in two levels:

    S_b = Σ p over block b (`BLOCK` entries, a vectorised float32 sum)      (B, blocks)
    b   = the first block whose cumulative float64 Σ S exceeds u·total
    v   = the first entry of block b whose float64 cumulative p, from the
          cumulative mass before b, exceeds u·total

0.8 ms for the same rows (benchmarks/README.md). Every cumulative value of the two-level way is a
float64 sum, not rounded to float32, so it is more exact than the plain one: it draws what an
inverse CDF summed wholly in float64 draws (tested), while the plain way's float32 cumulative
values move the intervals' ends by up to a float32 rounding of the total (about 6e-8 of it), so at
Qwen2's vocabulary 0.2 % of its draws land on a neighbour of the exact token. A token of probability 0 (outside top-k or top-p) has an empty interval and is never
drawn at either level; where a block's float32 sum S_b exceeds its entries' float64 sum by a
rounding and u·total falls in that sliver, the block's last token of nonzero probability is drawn.

Shape legend: ``B`` rows, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

BLOCK = 1024  # entries a block of the two-level way sums
TWO_LEVEL_FROM = 16 * BLOCK  # vocabularies from which two levels beat one cumulative sum (measured: 32,000 3x)


class DecodeSoftmax:
    """softmax (``log``: log-softmax) over the last dimension of a decode's scores (B, V), into one
    buffer for the whole decode: a call's result is overwritten by the next call.

    A fresh (B, V) result a token is a fresh allocation, and past glibc's mmap threshold (1 MiB for
    a large model, `rlhf.runtime.run.heap`) a fresh mapping the kernel page-faults in: at Qwen2's
    vocabulary and 32 rows 4,749 faults a token, 11 ms where the softmax itself takes 3
    (benchmarks/README.md). The same values as ``torch.softmax`` (``torch.log_softmax``): the same
    kernel, its ``out`` form."""

    def __init__(self, log: bool = False) -> None:
        self.function = torch.log_softmax if log else torch.softmax
        self.buffer: torch.Tensor | None = None  # (B', V), B' >= the rows of every call so far

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        rows, vocab = scores.shape
        held = self.buffer
        if held is None or held.shape[0] < rows or held.shape[1] != vocab or held.dtype != scores.dtype \
                or held.device != scores.device:
            held = self.buffer = torch.empty_like(scores, memory_format=torch.contiguous_format)  # (B, V)
        return self.function(scores, dim=-1, out=held[:rows])  # (B, V)


def sample_categorical(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (B, V), drawn with probability ``probs[b, v]`` (rows need not
    sum to one). Returns (B,). Off a CPU: ``torch.multinomial``."""
    if probs.device.type != "cpu":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    uniforms = torch.rand((probs.shape[0], 1), dtype=probs.dtype, device=probs.device)  # (B, 1)
    return inverse_cdf(probs, uniforms)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (B, V): the first whose cumulative probability exceeds
    ``uniforms`` (B, 1), in [0, 1), x the row's total. Returns (B,)."""
    if probs.shape[-1] < TWO_LEVEL_FROM:
        cdf = probs.cumsum(dim=-1)  # (B, V)
        u = _below(uniforms.to(cdf.dtype) * cdf[:, -1:], cdf[:, -1:])  # (B, 1)
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)  # (B,)
    return _two_level(probs, uniforms)


def _below(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``u`` (B, 1) kept under ``total`` (B, 1) where uniform x total rounds up to it, so that some
    cumulative value exceeds it."""
    return torch.minimum(u, total.nextafter(torch.zeros_like(total)))


def _two_level(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` by block sums, then a cumulative sum over one block per row (module docstring)."""
    rows, vocab = probs.shape
    full, tail = divmod(vocab, BLOCK)
    sums = probs.new_empty((rows, full + (tail > 0)))  # (B, blocks) S_b
    torch.sum(probs[:, : full * BLOCK].unflatten(1, (full, BLOCK)), dim=-1, out=sums[:, :full])
    if tail:
        torch.sum(probs[:, full * BLOCK:], dim=-1, out=sums[:, full])
    block_cdf = sums.double().cumsum(dim=-1)  # (B, blocks)
    u = _below(uniforms.double() * block_cdf[:, -1:], block_cdf[:, -1:])  # (B, 1)
    block = torch.searchsorted(block_cdf, u, right=True).clamp_(max=sums.shape[1] - 1)  # (B, 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # (B, 1) mass before it
    index = block * BLOCK + torch.arange(BLOCK, device=probs.device)  # (B, BLOCK) the block's entries
    outside = index >= vocab  # (B, BLOCK) past the vocabulary's end (the last block)
    local = probs.gather(1, index.clamp(max=vocab - 1)).masked_fill_(outside, 0.0)  # (B, BLOCK)
    within = torch.searchsorted(local.double().cumsum(dim=-1), u - before, right=True)  # (B, 1)
    positions = torch.arange(BLOCK, device=probs.device).expand(rows, BLOCK)  # (B, BLOCK)
    last_drawable = torch.where(local > 0, positions, 0).amax(dim=-1, keepdim=True)  # (B, 1)
    return (index.gather(1, torch.minimum(within, last_drawable))).squeeze(1)  # (B,)
