"""Exact checksums of weights and the sync deadline (rlhf/core/weight_check.py)."""

from __future__ import annotations

import time

import pytest
import torch

from rlhf.core import weight_check
from rlhf.core.weight_check import WeightSyncTimeout, add, checksum, first_mismatch, sync_deadline

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
def test_the_checksum_is_exact_and_sees_one_changed_element(dtype):
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(37, 11, generator=generator) * 50).to(dtype)
    assert checksum(tensor) == checksum(tensor.clone()) == checksum(tensor.t().contiguous().t())
    size = tensor.element_size()
    words = tensor.reshape(-1).view({1: torch.uint8, 2: torch.int16}.get(size, torch.int32)).tolist()
    assert checksum(tensor) == (sum(words) % 2**32, sum(w * w for w in words) % 2**32)  # by hand: Σw, Σw² mod 2**32
    positions = sum(w * (i % 65521 + 1) for i, w in enumerate(words)) % 2**32
    assert checksum(tensor, positional=True) == (*checksum(tensor), positions)
    changed = tensor.clone()
    changed.view(-1)[123] = changed.view(-1)[123] + 1  # one element, by the smallest step the dtype has
    assert checksum(changed) != checksum(tensor)


def test_a_tiny_update_of_a_large_tensor_is_seen():
    """What a sum of floats within a tolerance would miss: one step of lr 1e-7 on a 4M-element tensor."""
    tensor = torch.randn(2048, 2048) * 0.02
    updated = tensor - 1e-7 * torch.sign(torch.randn(2048, 2048))
    assert checksum(updated) != checksum(tensor)


def test_checksums_of_parts_add_up_to_the_fused_tensor_and_padding_is_free(monkeypatch):
    monkeypatch.setattr(weight_check, "CHUNK", 100)  # several chunks
    q, k, v = (torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(3))
    fused = torch.cat([q, k, v])
    assert checksum(fused) == add(checksum(q), checksum(k), checksum(v))
    padded = torch.cat([fused, torch.zeros(5, 16, dtype=torch.bfloat16)])  # vLLM's padded vocabulary
    assert checksum(padded) == checksum(fused)


def test_the_positional_checksum_is_the_same_in_chunks(monkeypatch):
    tensor = torch.randn(70_000)
    whole = checksum(tensor, positional=True)
    monkeypatch.setattr(weight_check, "CHUNK", 65521)  # positions restart their weights at each chunk
    assert checksum(tensor, positional=True) == whole


def test_the_positional_checksum_sees_a_permutation():
    tensor = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    assert checksum(tensor.t().contiguous()) == checksum(tensor)  # the order-free part cannot
    assert checksum(tensor.t().contiguous(), positional=True) != checksum(tensor, positional=True)


def test_first_mismatch_names_the_tensor():
    sent = {"a": (1, 2), "b": (3, 4)}
    assert first_mismatch(sent, {"a": (1, 2), "b": (3, 4)}) is None
    assert first_mismatch(sent, {"a": (1, 2)}) == "b was sent but did not reach the engine's weights"
    assert first_mismatch(sent, {"a": (1, 3), "b": (3, 4)}).startswith("a holds other values than were sent")


def test_the_deadline_interrupts_a_sync_waiting_in_python():
    began = time.monotonic()
    expected = r"^the test sync did not finish within 0.2 s \(--weight-sync-timeout-s\)"
    with pytest.raises(WeightSyncTimeout, match=expected):
        with sync_deadline(0.2, "the test sync"):
            while True:
                time.sleep(0.01)
    assert time.monotonic() - began < 5
    with sync_deadline(5, "a quick sync"):  # an ended sync leaves nothing behind
        pass
    time.sleep(0.1)
    with sync_deadline(0, "no deadline"):
        time.sleep(0.01)
