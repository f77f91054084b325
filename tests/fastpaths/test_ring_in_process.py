"""Ring attention (rlhf/fastpaths/ring_attention.py) on two ranks in this process: two threads, each
with a gloo process group of its own over an in-memory store (no torchrun, a few seconds), so the
fast tests check what test_ring_attention.py checks under torchrun:

* `ring_attention` on each rank's columns equals plain causal attention over the whole rows under
  a mask built by hand (causal, within a sequence, real keys only): outputs and the gradients of
  the queries, keys and values (the keys' and values' summed over the ring), padded rows (right,
  left, none) and a packed row whose sequences cross the slice boundary, head strides 1 and 2;
* `RingModel` gives the one-process model's log-probs, entropy, logits and parameter gradients
  (summed over the ranks, as the backends sum them), padded and packed, rows of ragged lengths
  and an odd length (the layout pads it to a multiple of the ring), and a micro-batch whose
  actions all lie on one rank's columns (the other still runs its layers' collectives);
* the layout by hand: where each token lies, its position and sequence, and each rank's columns;
* the layer's attention dropout in training only;
* the CUDA kernel path (``ring_flash_attn``, no GPU here) through a stand-in for the package: the
  packed row's sequence boundaries and every setting it is handed, and when the path is taken.
"""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlhf.core.distributed import RingGroup
from rlhf.core.logprobs import token_logprobs
from rlhf.fastpaths import ring_attention as ring_module
from rlhf.fastpaths.ring_attention import RingLayout, RingModel, ring_attention, ring_mask

pytestmark = pytest.mark.run

SIZE = 2


def on_two_ranks(work: Callable[[RingGroup], Any], head_stride: int = 1) -> list[Any]:
    """``work(ring)`` on each rank of a ring of two, in two threads; their results in rank order."""
    store = dist.HashStore()
    results: list[Any] = [None] * SIZE
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("ring", store), rank, SIZE, datetime.timedelta(seconds=60))
            results[rank] = work(RingGroup(size=SIZE, rank=rank, head_stride=head_stride, group=group))
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(SIZE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs"
    if errors:
        raise errors[0]
    return results


def close(got: torch.Tensor, expected: torch.Tensor, what: str, least: float = 0.05) -> None:
    scale = float(expected.abs().max())
    assert scale > least, f"{what}: the expected value is ~0, the comparison checks nothing"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale, msg=what)


# --- the attention function ------------------------------------------------------------------------


def mask_by_hand(segment: torch.Tensor) -> torch.Tensor:
    """(R, L, L) query i sees key j: j <= i, the same sequence, j a real token; and itself."""
    rows, length = segment.shape
    mask = torch.zeros(rows, length, length, dtype=torch.bool)
    for r in range(rows):
        for i in range(length):
            for j in range(i + 1):
                mask[r, i, j] = bool(segment[r, j] >= 0 and segment[r, j] == segment[r, i])
            mask[r, i, i] = True
    return mask


SEGMENTS = {
    "padded": torch.tensor([[0] * 7 + [-1] * 3, [-1] * 3 + [0] * 7, [0] * 10]),  # right-, left- and unpadded
    "packed": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, -1]]),  # sequence 1 crosses the slice boundary
}


@pytest.mark.parametrize("layout,stride", [("padded", 1), ("padded", 2), ("packed", 1)])
def test_ring_attention_is_plain_attention_over_the_whole_rows(layout, stride):
    segment = SEGMENTS[layout]
    rows, length = segment.shape
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(rows, 4, length, 8, generator=generator)  # (R, H, L, D)
    key = torch.randn(rows, 2, length, 8, generator=generator)  # (R, K, L, D): two query heads per key head
    value = torch.randn(rows, 2, length, 8, generator=generator)
    upstream = torch.randn(rows, length, 4, 8, generator=generator) * (segment >= 0)[:, :, None, None]  # (R, L, H, D)

    q, k, v = (t.clone().requires_grad_(True) for t in (query, key, value))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask_by_hand(segment)[:, None], scale=0.3, enable_gqa=True).transpose(1, 2)  # (R, L, H, D)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (q, k, v))

    def work(ring):
        layout_ = RingLayout(group=ring.group, size=ring.size, rank=ring.rank, head_stride=ring.head_stride,
                             input_ids=torch.zeros_like(segment), position_ids=torch.zeros_like(segment),
                             segment=segment, index=segment)
        start, stop = layout_.columns
        local = [t[:, :, start:stop].clone().requires_grad_(True) for t in (query, key, value)]
        token = ring_module._ACTIVE.set(layout_)
        try:
            out, _ = ring_attention(torch.nn.Module(), *local, None, scaling=0.3)  # (R, l, H, D)
        finally:
            ring_module._ACTIVE.reset(token)
        grads = torch.autograd.grad((out * upstream[:, start:stop]).sum(), local)
        return (start, stop), out.detach(), grads

    results = on_two_ranks(work, head_stride=stride)
    assert [columns for columns, _, _ in results] == [(0, length // 2), (length // 2, length)]
    real = (segment >= 0)[:, :, None, None]
    got = torch.cat([out for _, out, _ in results], dim=1)  # (R, L, H, D) the ranks' columns side by side
    close(got * real, expected.detach() * real, "out")
    for n, name in enumerate("qkv"):
        close(torch.cat([grads[n] for _, _, grads in results], dim=2), expected_grads[n], f"grad_{name}")


def test_ring_mask_by_hand_with_a_sliding_window():
    segment = torch.tensor([[0, 0, 0, 1, 1, 1]])
    layout = RingLayout(group=None, size=2, rank=1, head_stride=1, input_ids=segment, position_ids=segment,
                        segment=segment, index=segment)
    t, f = True, False
    assert ring_mask(layout).tolist() == [[[f, f, f, t, f, f], [f, f, f, t, t, f], [f, f, f, t, t, t]]]
    assert ring_mask(layout, sliding_window=2).tolist() == [[[f, f, f, t, f, f], [f, f, f, t, t, f],
                                                             [f, f, f, f, t, t]]]


# --- RingModel -------------------------------------------------------------------------------------


def batch(actions_on_first_columns_only: bool = False):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 300, (4, 11), generator=generator)  # T odd: padded to a multiple of 2
    attention_mask = torch.tensor([[1] * 11, [1] * 8 + [0] * 3, [0] * 2 + [1] * 9, [1] * 3 + [0] * 8])  # ragged
    action_mask = torch.zeros(4, 10, dtype=torch.long)
    if actions_on_first_columns_only:
        action_mask[0, 1:4], action_mask[1, 2:4] = 1, 1  # every predicted token is on rank 0's columns
    else:
        action_mask[0, 3:], action_mask[1, 4:7], action_mask[2, 5:], action_mask[3, 1:2] = 1, 1, 1, 1
    return input_ids, attention_mask, action_mask


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")


def one_process(model, input_ids, attention_mask, action_mask):
    weight = torch.linspace(0.5, 1.5, action_mask.numel()).view(action_mask.shape)  # (B, A) a loss that weighs each
    model.zero_grad()
    logprobs, entropy = token_logprobs(model, input_ids, attention_mask, action_mask, with_entropy=True)
    ((logprobs * weight + 0.1 * entropy) * action_mask).sum().backward()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits * attention_mask[:, :, None]
    return {"logprobs": logprobs.detach() * action_mask, "entropy": entropy.detach() * action_mask,
            "logits": logits, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}, weight


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("one_sided", [False, True], ids=["actions-everywhere", "actions-on-rank-0"])
def test_ring_model_gives_the_one_process_logprobs_logits_and_gradients(model, packed, one_sided):
    input_ids, attention_mask, action_mask = batch(one_sided)
    expected, weight = one_process(model, input_ids, attention_mask, action_mask)

    def work(ring):
        own = copy.deepcopy(model)
        ringed = RingModel(own, ring, packed=packed)
        logprobs, entropy = token_logprobs(ringed, input_ids, attention_mask, action_mask, with_entropy=True)
        ((logprobs * weight + 0.1 * entropy) * action_mask).sum().backward()
        with torch.no_grad():
            logits = ringed(input_ids, attention_mask).logits * attention_mask[:, :, None]
        return {"logprobs": logprobs.detach() * action_mask, "entropy": entropy.detach() * action_mask,
                "logits": logits, "grads": {n: p.grad.clone() for n, p in own.named_parameters()}}

    ranks = on_two_ranks(work)
    for name in ("logprobs", "entropy", "logits"):
        for rank, got in enumerate(ranks):  # every rank holds the whole result
            close(got[name], expected[name], f"{name} on rank {rank}")
    assert max(float(g.abs().max()) for g in expected["grads"].values()) > 0.05
    for name, grad in expected["grads"].items():  # the backends' sum over the ranks
        close(ranks[0]["grads"][name] + ranks[1]["grads"][name], grad, name, least=0.0)


def test_the_layouts_by_hand():
    ids = torch.tensor([[11, 12, 13], [0, 21, 22]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    ring = RingGroup(size=2, rank=1, head_stride=1)
    padded = RingModel(torch.nn.Module(), ring).layout(ids, mask)
    assert padded.input_ids.tolist() == [[11, 12, 13, 0], [0, 21, 22, 0]]  # T = 3 padded to 4
    assert padded.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]  # as the plain forward numbers them
    assert padded.segment.tolist() == [[0, 0, 0, -1], [-1, 0, 0, -1]]
    assert padded.index.tolist() == [[0, 1, 2], [-1, 5, 6]]  # flat positions in the (2 x 4) rows
    assert padded.columns == (2, 4)
    packed = RingModel(torch.nn.Module(), ring, packed=True).layout(ids, mask)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 0]]  # 5 real tokens padded to 6
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert packed.segment.tolist() == [[0, 0, 0, 1, 1, -1]]
    assert packed.index.tolist() == [[0, 1, 2], [-1, 3, 4]]
    assert packed.columns == (3, 6)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "training"])
def test_attention_dropout_only_in_training(training):
    """The model's attention dropout applies in training only: in eval mode the ring's output is
    plain attention's whatever the dropout the layer asks for."""
    segment = SEGMENTS["padded"]
    rows, length = segment.shape
    generator = torch.Generator().manual_seed(4)
    query, key, value = (torch.randn(rows, heads, length, 8, generator=generator) for heads in (4, 2, 2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask_by_hand(segment)[:, None], scale=0.3, enable_gqa=True).transpose(1, 2)

    def work(ring):
        layout = RingLayout(group=ring.group, size=ring.size, rank=ring.rank, head_stride=1,
                            input_ids=segment, position_ids=segment, segment=segment, index=segment)
        start, stop = layout.columns
        module = torch.nn.Module().train(training)
        token = ring_module._ACTIVE.set(layout)
        try:
            out, _ = ring_attention(module, *(t[:, :, start:stop] for t in (query, key, value)), None, scaling=0.3,
                                    dropout=0.9)
        finally:
            ring_module._ACTIVE.reset(token)
        return out

    got = torch.cat(on_two_ranks(work), dim=1)
    real = (segment >= 0)[:, :, None, None]
    same = torch.allclose(got * real, expected * real, atol=1e-5)
    assert same is not training


def fake_ring_flash_attn(calls):
    """A stand-in for the ``ring_flash_attn`` package that records what it is given."""
    import importlib.machinery
    import types

    module = types.ModuleType("ring_flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("ring_flash_attn", None)

    def prepare(cu_seqlens, *, causal, rank, world_size):
        calls["prepare"] = {"cu_seqlens": cu_seqlens.tolist(), "dtype": cu_seqlens.dtype, "causal": causal,
                            "rank": rank, "world_size": world_size}
        return "cu_q", "cu_k", 7, 12, "local slice"

    def varlen(query, key, value, cu_q, cu_k, max_q, max_k, **options):
        calls["varlen"] = {"shapes": [tuple(t.shape) for t in (query, key, value)],
                           "lengths": (cu_q, cu_k, max_q, max_k), **options}
        return torch.ones(query.shape)  # (l, H, D)

    module.llama3_flash_attn_prepare_cu_seqlens = prepare
    module.llama3_flash_attn_varlen_func = varlen
    return module


@pytest.mark.parametrize("window", [None, 4])
def test_packed_half_precision_cuda_rows_go_to_ring_flash_attn_with_the_sequences_boundaries(monkeypatch, window):
    """The CUDA kernel path (no GPU here): the packed row's sequence starts as ``cu_seqlens`` (padding
    at the end one more sequence), the head stride, window, dropout, scale and group handed on."""
    import sys
    import types

    calls: dict = {}
    monkeypatch.setitem(sys.modules, "ring_flash_attn", fake_ring_flash_attn(calls))
    segment = SEGMENTS["packed"]  # (1, 12): sequences at 0, 3, 9, padding from 11
    layout = RingLayout(group="the ring", size=2, rank=1, head_stride=2, input_ids=segment, position_ids=segment,
                        segment=segment, index=segment)
    query, key, value = torch.zeros(1, 4, 6, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8)
    out = ring_module._flash_ring(query, key, value, layout, 0.3, 0.1, window)
    assert out.shape == (1, 6, 4, 8) and bool((out == 1).all())
    assert calls["prepare"] == {"cu_seqlens": [0, 3, 9, 11, 12], "dtype": torch.int32, "causal": True, "rank": 1,
                                "world_size": 2}
    assert calls["varlen"] == {"shapes": [(6, 4, 8), (6, 2, 8), (6, 2, 8)], "lengths": ("cu_q", "cu_k", 7, 12),
                               "heads_k_stride": 2, "local_k_slice": "local slice", "dropout_p": 0.1,
                               "softmax_scale": 0.3, "causal": True,
                               "window_size": (-1, -1) if window is None else (window - 1, 0), "group": "the ring"}
    half_on_cuda = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert ring_module._flash_ring_usable(half_on_cuda, layout)
    padded = RingLayout(**{**layout.__dict__, "input_ids": torch.zeros(3, 12, dtype=torch.long)})
    assert not ring_module._flash_ring_usable(half_on_cuda, padded)  # padded rows: the torch path
    assert not ring_module._flash_ring_usable(types.SimpleNamespace(is_cuda=True, dtype=torch.float32), layout)
    assert not ring_module._flash_ring_usable(types.SimpleNamespace(is_cuda=False, dtype=torch.bfloat16), layout)
    monkeypatch.delitem(sys.modules, "ring_flash_attn")
    import importlib.util

    if importlib.util.find_spec("ring_flash_attn") is None:
        assert not ring_module._flash_ring_usable(half_on_cuda, layout)  # not installed
