"""Freed tensors go back to the operating system, so a run's peak memory is what it holds, not
what it once held.

glibc's malloc serves a block from its heap unless it is at least the mmap threshold, and raises
that threshold to the size of every mapped block freed (up to 32 MiB). A training step frees
blocks of tens of MiB (activations, a chunk of logits), so after the first step they come from the
heap, where freed memory stays with the process and fragments: on a 95M-parameter model with a
151,936-token vocabulary that added 300-450 MB to the peak resident set (benchmarks/README.md,
"Memory at a real vocabulary"). `return_freed_blocks` fixes the threshold at 1 MiB, which also
stops its growth: larger blocks are mapped and unmapped when freed. A user who set glibc's
``MALLOC_MMAP_THRESHOLD_`` keeps it; other C libraries (musl, macOS) are left alone.

Mapping costs time: every block from the threshold up is a fresh mapping, page-faulted in and
unmapped again each time a step allocates it. For a small model (`threshold_for`: weights under
`SMALL_MODEL_BYTES` on disk) the threshold is fixed at 32 MiB instead, glibc's own ceiling: on a
4.4M-parameter model a DPO step took 0.8x the CPU time of 1 MiB's for about 70 MB more resident
memory, while on the 95M-parameter model above 1 MiB keeps the peak down (benchmarks/README.md,
"The glibc mmap threshold").

Compiled kernels are memory a run holds too. oneDNN, which runs torch's half-precision products on
a CPU and float32 ones under ``--cpu-linear onednn``, compiles a kernel for every distinct problem
shape, and both it and torch's layer over it (ideep) keep up to 1,024 of them, about 0.6 MB each:
training on rows of varying lengths meets a new shape with almost every micro-batch, so a 60-step
SFT of a 4.4M-parameter model grew from 830 MB to 1.57 GB and was still growing.
`bound_kernel_caches` keeps `KERNEL_CACHE_CAPACITY` of each (the same run stayed near 890 MB, no
slower): a micro-batch of a new length meets about a dozen new shapes and a decode step a handful,
and a shape not met again within 64 others is rarely met again; compiling one anew takes a few
ms. oneDNN reads the settings once, at its first product, so this must run before any; a user's
own ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` or ``LRU_CACHE_CAPACITY`` is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MMAP_THRESHOLD = 1 << 20  # bytes: blocks from here on are mapped, and returned when freed
SMALL_MODEL_THRESHOLD = 32 << 20  # bytes: the threshold for a small model (glibc's dynamic ceiling on 64-bit)
SMALL_MODEL_BYTES = 128 << 20  # weights on disk below this make a small model (32M float32 parameters)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
KERNEL_CACHE_CAPACITY = 64  # compiled oneDNN kernels kept by oneDNN and by ideep, each
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's (torch)


def weights_bytes(model: str | None) -> int | None:
    """The size of a local model directory's weight files, or None (a hub name, no weights found)."""
    if not model:
        return None
    try:
        folder = Path(model)
        if not folder.is_dir():
            return None
        total = sum(path.stat().st_size for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES)
    except OSError:
        return None
    return total or None


def threshold_for(model: str | None) -> int:
    """`SMALL_MODEL_THRESHOLD` for a local model whose weights take under `SMALL_MODEL_BYTES`, else
    `MMAP_THRESHOLD` (a large or unknown model: memory first)."""
    size = weights_bytes(model)
    return SMALL_MODEL_THRESHOLD if size is not None and size < SMALL_MODEL_BYTES else MMAP_THRESHOLD


def return_freed_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes in this process; whether it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # the user's own setting, read by glibc at start
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, _ = libc.mallopt, libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> list[str]:
    """Keep at most ``capacity`` compiled kernels in each of oneDNN's and ideep's caches in this
    process (and the processes it starts), unless the user set them; the variables it set. Takes
    effect only before the process's first oneDNN product."""
    chosen = [name for name in KERNEL_CACHES if name not in os.environ]
    os.environ.update({name: str(capacity) for name in chosen})
    return chosen
