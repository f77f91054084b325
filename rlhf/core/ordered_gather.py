"""Row gathers whose backward adds repeated rows in the same order on every run.

Where an index repeats (the n samples of a prompt all read the logits at the prompt's last
token), the backward of a gather sums several gradients into one row. The backward of torch's
plain indexing ``x[index]`` on a CPU does that with atomic float adds spread over the threads
once the gather holds 32k elements or more, so the rounding of the sum follows the threads'
timing: the same command and seed end in weights that differ in the last bits from one try to
the next, more often on a busy machine. ``index_select``'s backward (``index_add_``) adds the
rows one after another on a CPU. On CUDA it is the other way round (``index_add_`` adds with
atomics, indexing's backward sorts the index first), so each device gets the gather whose
backward is ordered there.
"""

from __future__ import annotations

import torch


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` for a 1-D integer ``index`` (K,) into the first dimension of ``source``
    (N, ...), giving (K, ...), with a backward that sums repeated rows in a fixed order."""
    if index.dim() != 1:
        raise ValueError(f"gather_rows takes a 1-D index, got shape {tuple(index.shape)}")
    if source.device.type == "cuda":
        return source[index]
    return source.index_select(0, index)
