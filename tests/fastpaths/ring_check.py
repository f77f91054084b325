"""Run by test_ring_attention.py under torchrun (2 ranks, gloo): ring attention and `RingModel`
against the one-process computations, values and gradients, padded and packed.

Every rank computes the one-process reference itself (no collectives) and its ring share; the
parameter gradients of the ring are summed over the ranks (as the backends do). Rank 0 saves
``{case: (expected, got)}`` pairs to argv[2].
"""

import sys

import torch
import torch.distributed as dist

from rlhf.core.distributed import exit_process, init_from_environment
from rlhf.core.logprobs import token_logprobs
from rlhf.fastpaths.packing import PackedModel
from rlhf.fastpaths.ring_attention import RingLayout, RingModel, ring_attention


def plain_attention(query, key, value, segment):
    """sdpa over the whole rows: causal, within a segment, real keys only (every query sees itself)."""
    length = query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0)
    mask = (same & causal) | torch.eye(length, dtype=torch.bool)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None],
                                                            enable_gqa=True).transpose(1, 2)  # (R, L, H, D)


def attention_case(ring, segment, stride):
    """ring_attention on this rank's columns against sdpa on the whole rows; gradients of q, k, v."""
    generator = torch.Generator().manual_seed(3)
    rows, length = segment.shape
    query = torch.randn(rows, 4, length, 8, generator=generator, requires_grad=True)
    key = torch.randn(rows, 2, length, 8, generator=generator, requires_grad=True)
    value = torch.randn(rows, 2, length, 8, generator=generator, requires_grad=True)
    weight = torch.randn(rows, length, 4, 8, generator=generator)  # a loss that weighs every output
    real = (segment >= 0)[:, :, None, None]
    expected = plain_attention(query, key, value, segment)
    (expected * weight * real).sum().backward()
    grads = [t.grad.clone() for t in (query, key, value)]
    layout = RingLayout(group=ring.group, size=ring.size, rank=ring.rank, head_stride=stride,
                        input_ids=torch.zeros_like(segment), position_ids=torch.zeros_like(segment), segment=segment,
                        index=segment)
    start, stop = layout.columns
    local = [t.detach()[:, :, start:stop].clone().requires_grad_(True) for t in (query, key, value)]
    from rlhf.fastpaths import ring_attention as module

    token = module._ACTIVE.set(layout)
    try:
        got, _ = ring_attention(torch.nn.Module(), *local, None, scaling=8 ** -0.5)
    finally:
        module._ACTIVE.reset(token)
    (got * weight[:, start:stop] * real[:, start:stop]).sum().backward()
    return {"out": ((expected * real)[:, start:stop].detach(), (got * real[:, start:stop]).detach()),
            **{f"grad_{n}": (g[:, :, start:stop], t.grad) for n, g, t in zip("qkv", grads, local)}}


def model_case(model, ring, batch, packed, with_entropy=True):
    """`RingModel.token_logprobs` (and the call) against `token_logprobs` of the model itself."""
    input_ids, attention_mask, action_mask = batch
    weight = torch.linspace(0.5, 1.5, action_mask.numel()).view(action_mask.shape)
    reference = PackedModel(model) if packed else model
    model.zero_grad()
    expected, expected_entropy = token_logprobs(reference, input_ids, attention_mask, action_mask,
                                                with_entropy=with_entropy)
    ((expected * weight * action_mask).sum() + (expected_entropy * action_mask).sum()).backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ringed = RingModel(model, ring, packed=packed)
    got, got_entropy = token_logprobs(ringed, input_ids, attention_mask, action_mask, with_entropy=with_entropy)
    ((got * weight * action_mask).sum() + (got_entropy * action_mask).sum()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # the backends' sum over every rank
        grads[name] = grad
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits * attention_mask[:, :, None]
        called = ringed(input_ids, attention_mask).logits * attention_mask[:, :, None]
    return {"logprobs": ((expected * action_mask).detach(), (got * action_mask).detach()),
            "entropy": ((expected_entropy * action_mask).detach(), (got_entropy * action_mask).detach()),
            "call": (logits, called), "grads": (expected_grads, grads)}


def main(model_dir: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    dist_context = init_from_environment("gloo").with_rings(2, head_stride=1)
    ring = dist_context.ring
    results = {}
    # padded rows: right, left and no padding
    segment = torch.tensor([[0] * 7 + [-1] * 3, [-1] * 3 + [0] * 7, [0] * 10])
    for stride in (1, 2):
        results[f"attention/padded/stride{stride}"] = attention_case(ring, segment, stride)
    # a packed row: three sequences, one crossing the slice boundary, padding at the end
    packed = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, -1]])
    results["attention/packed"] = attention_case(ring, packed, 1)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 300, (3, 11), generator=generator)  # odd T: the layout pads it to a multiple of 2
    attention_mask = torch.tensor([[1] * 11, [1] * 8 + [0] * 3, [0] * 2 + [1] * 9])
    action_mask = torch.zeros(3, 10, dtype=torch.long)
    action_mask[0, 3:], action_mask[1, 4:7], action_mask[2, 5:] = 1, 1, 1
    batch = (input_ids, attention_mask, action_mask)
    for packed_rows in (False, True):
        results[f"model/{'packed' if packed_rows else 'padded'}"] = model_case(model, ring, batch, packed_rows)
    if dist_context.is_main:
        torch.save(results, out)
    dist_context.close()
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
