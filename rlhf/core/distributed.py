"""Data parallelism, seen by workers and the trainer through one small object.

The scheme (the same under a launcher such as torchrun and under Ray):

* every data-parallel rank holds the whole experience batch;
* minibatches are drawn with the same seeded permutation on every rank, and rank r trains on
  rows ``r, r + W, r + 2W, ...`` of each minibatch (W = world size);
* loss normalisers (token and sequence counts) are those of the whole minibatch, so each rank's
  micro-batch losses are its share of the step loss;
* backends **sum** gradients over ranks, so the step gradient is the full-minibatch gradient
  whatever the number of ranks (docs/algorithms.md: ``token_mean`` does not depend on the split).

With sequence parallelism (``--ring-attn-size N``, `RingGroup`) the N consecutive ranks of a ring
group are one data-parallel rank: they hold the same rows (`DistContext.shard` by data-parallel
rank), each runs its slice of every sequence (`rlhf.fastpaths.ring_attention`), and
`DistContext.all_gather` answers one object per data-parallel rank (the ring's first rank's). Each
ring rank's gradient is its slice's share of the loss gradient, so the backends' sum over every rank
stays right, unchanged.
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlhf.core.errors import ConfigError


@dataclass(frozen=True)
class RingGroup:
    """This rank's ring group (``--ring-attn-size``): ``size`` consecutive ranks that split each sequence."""

    size: int
    rank: int  # place in the ring, 0 .. size - 1
    head_stride: int = 1  # key/value heads gathered at a time (``--ring-head-stride``)
    group: Any = field(default=None, compare=False, repr=False)  # its torch.distributed process group


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    ring: RingGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank: the rank itself, or its ring group's number."""
        return self.rank // self.ring.size if self.ring is not None else self.rank

    @property
    def dp_size(self) -> int:
        """The data-parallel degree: W, or W / N with rings of N ranks."""
        return self.world_size // self.ring.size if self.ring is not None else self.world_size

    def shard(self, items: list[Any]) -> list[Any]:
        """This data-parallel rank's share: items ``r, r + D, ...`` (r = `dp_rank`, D = `dp_size`)."""
        return items[self.dp_rank::self.dp_size]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's ``obj``, in rank order (picklable objects); with rings, the
        first rank's of each ring (its other ranks hold the same rows)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out[::self.ring.size] if self.ring is not None else out

    def with_rings(self, size: int, head_stride: int = 1) -> DistContext:
        """This context with ring groups of ``size`` consecutive ranks (every rank must call it)."""
        if size <= 1:
            return self
        if self.world_size % size:
            raise ConfigError(f"--ring-attn-size {size} needs a number of processes that it divides (this run has "
                              f"{self.world_size}); start it with e.g. torchrun --nproc-per-node {size}")
        import torch.distributed as dist

        mine = None
        for first in range(0, self.world_size, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(first, first + size)))
            if first <= self.rank < first + size:
                mine = group
        return dataclasses.replace(self, ring=RingGroup(size=size, rank=self.rank % size, head_stride=head_stride,
                                                         group=mine))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Leave the process group once every rank is done. Objects that hold process groups and are
        only reachable through reference cycles (DeepSpeed engines) are collected first, while the
        groups still work: destroyed later, during interpreter shutdown, their backend's threads can
        abort the process ("terminate called without an active exception")."""
        if self.active:
            import gc

            import torch.distributed as dist

            if dist.is_initialized():
                gc.collect()
                dist.barrier()
                dist.destroy_process_group()
                gc.collect()


SINGLE = DistContext()


def unshard(shards: list[list[Any]]) -> list[Any]:
    """Inverse of `DistContext.shard` over all ranks: ``[[a, c], [b, d]] -> [a, b, c, d]``."""
    out = []
    for index in range(max((len(s) for s in shards), default=0)):
        out += [s[index] for s in shards if index < len(s)]
    return out


def init_from_environment(backend: str | None = None) -> DistContext:
    """Join the process group a launcher (torchrun, deepspeed) describes in WORLD_SIZE/RANK; else single."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SINGLE
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())


def exit_process(code: int = 0) -> None:
    """End a data-parallel worker process now, after flushing its output (``os._exit``).

    Called by ``rlhf`` commands under a launcher (and by scripts that follow them) once the work
    is written and the process group is closed: it skips the interpreter's teardown, in which the
    C++ objects of torch.distributed and DeepSpeed are destroyed in no particular order, which
    aborted one rank in roughly one run of thirty (SIGABRT after a successful run).
    """
    import logging
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def launched_with_ranks() -> bool:
    """This process is one of several started by a launcher (torchrun, deepspeed)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
