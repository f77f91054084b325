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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 1 << 20  # bytes: blocks from here on are mapped, and returned when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


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
