"""`WeightBroadcast` (--weight-sync broadcast): rank 0's tensors arrive bit for bit in every
receiver's parameters, over gloo between three local processes, in buckets cut the same way on
both sides; a receiver whose parameters differ is told which ones."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from rlhf.runtime.ray.weight_broadcast import Bucket, WeightBroadcast, WeightSyncError, buckets, check_manifest

BUCKET_BYTES = 1024
# name -> (shape, dtype); "big" (16 KiB) travels alone, the bfloat16 one starts a bucket of its own
LAYOUT = {"a": ((3, 4), torch.float32), "b": ((5,), torch.float32), "big": ((64, 64), torch.float32),
          "h": ((2, 3), torch.bfloat16), "c": ((7,), torch.float32)}


def values(round_: int) -> dict[str, torch.Tensor]:
    """What the sender holds in round ``round_`` (seeded, so every process can recompute it)."""
    generator = torch.Generator().manual_seed(100 + round_)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, (shape, dtype) in LAYOUT.items()}


def member(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    sync = WeightBroadcast.join("127.0.0.1", port, rank, 3, backend="gloo", timeout_s=60, bucket_bytes=BUCKET_BYTES)
    params = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in LAYOUT.items()}
    for round_ in (1, 2):
        if rank == 0:
            moved = sync.send(values(round_).items())
        else:
            versions = {name: t._version for name, t in params.items()}
            moved = sync.receive(params)
            assert all(params[name]._version > versions[name] for name in params), "a write went unnoticed"
        torch.save({"bytes": moved, "params": {k: v.clone() for k, v in params.items()}}, f"{out}/{rank}_{round_}.pt")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.cluster
def test_every_receiver_gets_the_senders_tensors_bit_for_bit(tmp_path):
    mp.spawn(member, args=(free_port(), str(tmp_path)), nprocs=3, join=True)
    total = sum(t.numel() * t.element_size() for t in values(1).values())
    for round_ in (1, 2):  # round 1 starts with the manifest; round 2 sends tensors only
        sent = torch.load(tmp_path / f"0_{round_}.pt")
        assert sent["bytes"] == total
        for rank in (1, 2):
            got = torch.load(tmp_path / f"{rank}_{round_}.pt")
            assert got["bytes"] == total
            for name, expected in values(round_).items():
                assert got["params"][name].dtype == expected.dtype
                assert torch.equal(got["params"][name], expected), (rank, round_, name)


@pytest.mark.unit
def test_buckets_are_consecutive_single_dtype_and_bounded():
    manifest = [(name, shape, str(dtype).removeprefix("torch.")) for name, (shape, dtype) in LAYOUT.items()]
    assert buckets(manifest, BUCKET_BYTES) == [
        Bucket(0, 2, "float32", 12 + 5),  # a + b: 68 bytes
        Bucket(2, 3, "float32", 64 * 64),  # larger than a bucket: alone
        Bucket(3, 4, "bfloat16", 6),  # another dtype
        Bucket(4, 5, "float32", 7),
    ]
    assert buckets(manifest, 10**9) == [Bucket(0, 3, "float32", 12 + 5 + 4096), Bucket(3, 4, "bfloat16", 6),
                                        Bucket(4, 5, "float32", 7)]
    assert buckets([], BUCKET_BYTES) == []


@pytest.mark.unit
def test_a_receiver_whose_parameters_differ_is_told_which():
    manifest = [("w", (2, 3), "float32"), ("v", (4,), "float32"), ("u", (1,), "bfloat16")]
    check_manifest(manifest, {"w": torch.zeros(2, 3), "v": torch.zeros(4), "u": torch.zeros(1, dtype=torch.bfloat16)})
    with pytest.raises(WeightSyncError) as caught:
        check_manifest(manifest, {"w": torch.zeros(3, 2), "u": torch.zeros(1)})
    message = str(caught.value)
    assert "w: sent as float32[2, 3], here float32[3, 2]" in message
    assert "v: no such parameter here" in message
    assert "u: sent as bfloat16[1], here float32[1]" in message


@pytest.mark.unit
def test_broadcast_in_the_local_runtime_is_warned_about(plugins):
    from rlhf.runtime.config.train_config import TrainConfig
    from rlhf.runtime.config.train_plan import RunPlan

    def warnings(**options):
        return RunPlan.make(TrainConfig(model="m", data=["d"], reward=["exact_match"], **options), plugins).warnings()

    assert warnings(weight_sync="broadcast") == [
        "--weight-sync broadcast: the local runtime's engine reads the policy in this process; weights travel only "
        "between Ray actors (--runtime ray)"]
    assert warnings(weight_sync="broadcast", runtime="ray") == warnings() == []
