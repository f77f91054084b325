"""Policy weights over torch.distributed: one sender (rank 0) broadcasts to every receiver.

The Ray runtime's ``--weight-sync broadcast`` (rlhf/runtime/ray/groups.py): policy rank 0 and
every rollout actor join a process group of their own (`WeightBroadcast.join`: NCCL when the
tensors live on a GPU, gloo on the CPU), apart from the policy's data-parallel group, so the
two never mix. Each sync then moves the tensors once, from the sender's memory into each
receiver's parameters, with no copy in Ray's object store.

What travels:

* the first sync starts with a manifest, the list of ``(name, shape, dtype)`` in the sender's
  order; each receiver checks it against its own parameters (every name known, shapes and
  dtypes equal) and remembers it. Later syncs send tensors only, in the manifest's order;
* the tensors go in buckets: consecutive tensors of one dtype, up to ``bucket_bytes`` together
  (a larger tensor alone), flattened into one buffer and broadcast as one message. Both sides
  cut the same buckets from the manifest, so no bucket needs a header. A bucket of one tensor
  lands straight in the receiver's parameter when its storage can take it (same device,
  contiguous); otherwise the receiver copies each slice of the buffer into its parameter. A
  sync holds at most one bucket of extra memory on either side;
* with ``verify`` (``--verify-weight-sync``, on by default) the sender ends each sync with the
  exact checksums (rlhf/core/weight_check.py, positional) of the tensors it sent; each receiver
  compares them with those of its model's parameters as they are after the sync
  (rlhf/runtime/ray/actors.py): a tensor that differs stops the run (`WeightSyncError`, naming it).

Nothing here imports torch at module import.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlhf.core.weight_check import WeightSyncError

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 * 2**20  # the most one broadcast message carries (a larger tensor travels alone)

Entry = tuple[str, tuple[int, ...], str]  # name, shape, dtype (torch's name without "torch.")


__all__ = ["BUCKET_BYTES", "Bucket", "WeightBroadcast", "WeightSyncError", "buckets", "check_manifest"]


@dataclass(frozen=True)
class Bucket:
    """Consecutive manifest entries ``first .. last - 1``, of one dtype, sent as one flat buffer."""

    first: int
    last: int
    dtype: str
    numel: int


def buckets(manifest: list[Entry], bucket_bytes: int) -> list[Bucket]:
    """The buckets both sides cut from a manifest: in order, one dtype each, at most ``bucket_bytes``
    (a tensor larger than that alone)."""
    import torch

    out: list[Bucket] = []
    start, numel, nbytes = 0, 0, 0
    for index, (_, shape, dtype) in enumerate(manifest):
        count = _numel(shape)
        size = count * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        if index > start and (dtype != manifest[start][2] or nbytes + size > bucket_bytes):
            out.append(Bucket(start, index, manifest[start][2], numel))
            start, numel, nbytes = index, 0, 0
        numel += count
        nbytes += size
    if manifest:
        out.append(Bucket(start, len(manifest), manifest[start][2], numel))
    return out


def check_manifest(manifest: list[Entry], params: Mapping[str, Any]) -> None:
    """Raise `WeightSyncError` when a receiver's ``params`` cannot take what the manifest announces."""
    problems = []
    for name, shape, dtype in manifest:
        param = params.get(name)
        if param is None:
            problems.append(f"{name}: no such parameter here")
        elif tuple(param.shape) != tuple(shape) or str(param.dtype).removeprefix("torch.") != dtype:
            problems.append(f"{name}: sent as {dtype}{list(shape)}, here {str(param.dtype).removeprefix('torch.')}"
                            f"{list(param.shape)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightSyncError("the rollout's copy of the policy does not match the policy's weights: "
                              + "; ".join(problems[:5]) + more + ". Both must load the same model with the same "
                              "adapter settings")


class WeightBroadcast:
    """This process's membership of a weight-broadcast group (rank 0 sends, the others receive)."""

    def __init__(self, group: Any, rank: int, world_size: int, device: Any, bucket_bytes: int = BUCKET_BYTES):
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.bucket_bytes = bucket_bytes
        self.manifest: list[Entry] | None = None
        self.sent_checksums: dict[str, tuple[int, ...]] | None = None  # the last sync's, with verify
        self._buckets: list[Bucket] = []

    @classmethod
    def join(cls, address: str, port: int, rank: int, world_size: int, *, backend: str, timeout_s: float,
             bucket_bytes: int = BUCKET_BYTES) -> WeightBroadcast:
        """Rendezvous at ``address:port`` (rank 0 serves the store there); blocks until every rank joined.

        The group is built from its own store, outside torch.distributed's default group, so a
        process may also belong to a data-parallel group."""
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout)
        store = dist.PrefixStore("rlhf-weight-sync", store)
        if backend == "nccl":  # unverified without a GPU
            device = torch.device("cuda", torch.cuda.current_device())
            group = dist.ProcessGroupNCCL(store, rank, world_size)
        elif backend == "gloo":
            device = torch.device("cpu")
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            raise ValueError(f"weight-sync backend must be nccl or gloo, got {backend!r}")
        member = cls(group, rank, world_size, device, bucket_bytes)
        member._store = store  # the group's rendezvous; kept alive with it
        return member

    # --- the sender ------------------------------------------------------------------------

    def send(self, named: Iterable[tuple[str, Any]], *, verify: bool = False) -> int:
        """Broadcast ``(name, tensor)`` pairs (rank 0); the first call announces their manifest, later
        calls must send the same names, shapes and dtypes in the same order. Returns the bytes sent.
        ``verify``: then the checksums of what was sent (every receiver must pass ``verify`` too)."""
        import torch

        assert self.rank == 0, "only rank 0 of a weight-broadcast group sends"
        tensors = [(name, tensor.detach()) for name, tensor in named]
        manifest = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]
        if self.manifest is None:
            self._broadcast_object(manifest)
            self._adopt(manifest)
        elif manifest != self.manifest:
            raise WeightSyncError("the policy's trainable parameters changed since the first weight sync "
                                  "(names, shapes or dtypes); the rollout actors expect the first set")
        sent = 0
        for bucket in self._buckets:
            parts = [t for _, t in tensors[bucket.first:bucket.last]]
            if len(parts) == 1 and parts[0].device == self.device and parts[0].is_contiguous():
                flat = parts[0]  # sent from where it is
            else:
                flat = torch.cat([t.reshape(-1).to(self.device) for t in parts])  # (numel,)
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        if verify:
            from rlhf.core.weight_check import checksum

            self._broadcast_object({name: checksum(t, positional=True) for name, t in tensors})
        return sent

    # --- a receiver ------------------------------------------------------------------------

    def receive(self, params: Mapping[str, Any], *, verify: bool = False) -> int:
        """Receive one sync into ``params`` (name -> tensor, written in place); returns the bytes received.

        The first call receives and checks the manifest (`check_manifest`). ``verify`` (as the sender's):
        then also the sender's checksums, kept in ``sent_checksums`` for the caller to compare with what
        its model holds (`rlhf.core.weight_check.first_mismatch`)."""
        import torch

        assert self.rank != 0, "rank 0 of a weight-broadcast group sends"
        if self.manifest is None:
            manifest = self._broadcast_object(None)
            check_manifest(manifest, params)
            self._adopt(manifest)
        received = 0
        with torch.no_grad():
            for bucket in self._buckets:
                entries = self.manifest[bucket.first:bucket.last]
                targets = [params[name] for name, _, _ in entries]
                if len(targets) == 1 and targets[0].device == self.device and targets[0].is_contiguous():
                    self._broadcast(targets[0].detach())  # straight into the parameter
                    _written(targets[0])
                else:
                    flat = torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=self.device)
                    self._broadcast(flat)
                    offset = 0
                    for (_, shape, _), target in zip(entries, targets):
                        count = _numel(shape)
                        target.copy_(flat[offset:offset + count].view(shape))  # (shape) one parameter
                        offset += count
                received += bucket.numel * torch.empty((), dtype=getattr(torch, bucket.dtype)).element_size()
        if verify:
            self.sent_checksums = self._broadcast_object(None)
        return received

    # --- transport -------------------------------------------------------------------------

    def _adopt(self, manifest: list[Entry]) -> None:
        self.manifest = [(name, tuple(shape), dtype) for name, shape, dtype in manifest]
        self._buckets = buckets(self.manifest, self.bucket_bytes)

    def _broadcast(self, tensor: Any) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def _broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (pickled: its length, then its bytes)."""
        import torch

        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)  # (L,)
            length = torch.tensor([payload.numel()], dtype=torch.int64)  # (1,)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        length = length.to(self.device)
        self._broadcast(length)
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        payload = payload.to(self.device)
        self._broadcast(payload)
        # only rank 0's own pickle is ever unpickled, inside the run's own processes
        return value if self.rank == 0 else pickle.loads(payload.cpu().numpy().tobytes())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _written(tensor: Any) -> None:
    """Tell autograd's version counter that a collective wrote ``tensor`` (it counts only torch's own
    in-place operations), so whoever watches it for changes (the vllm engine) sees new weights."""
    import torch

    torch.autograd.graph.increment_version(tensor)
