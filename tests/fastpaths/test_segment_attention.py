"""Attention per segment over prefix-shared rows (rlhf/fastpaths/segment_attention.py):

* the layout by hand: where the prefix and each remainder lie in a group row, and when attention
  per segment pays (many or long remainders) and when it does not (DPO-sized pairs);
* `segment_attention` equals sdpa under the rows' mask, outputs and the gradients of q, k and v, on
  rows padded on both sides, a row that is a prefix of another, a group of one, groups whose
  prefixes differ in length, with and without grouped key-value heads;
* the shared forward of a Llama, a Qwen2 (biased projections, grouped heads) and a Llama with LoRA
  adapters gives the separate forwards' log-probs and parameter gradients, and is the path taken;
  packed (``--packing``), over the rows' real tokens only, the same;
* models it does not reproduce (eager attention, gradient checkpointing, attention dropout in
  training, a data-parallel wrapper) run their own forward under the mask;
* a segment forward that went wrong is caught on the first micro-batch: a warning, then separate
  forwards.
"""

from __future__ import annotations

import pytest
import torch

import rlhf.fastpaths.prefix_sharing as sharing
import rlhf.fastpaths.segment_attention as segments
from rlhf.core.logprobs import token_logprobs
from rlhf.fastpaths.prefix_sharing import checked_for_sharing, share_prefixes, shared_token_logprobs, sharing_path
from rlhf.fastpaths.verdicts import verdict
from rlhf.fastpaths.segment_attention import segment_attention, segment_forward_supported, segment_layout, segments_pay
from tests.helpers import assert_same_gradients, shared_batch

pytestmark = pytest.mark.unit


def test_segment_layout_by_hand():
    # group 0: prefix 1 2, row 0's remainder 3 4, row 1's 5; group 1: a row of its own, then padding
    layout = segment_layout(torch.tensor([[0, 0, 1, 1, 2], [0, 0, -1, -1, -1]]))
    t, f = True, False
    assert layout.prefix_valid.tolist() == [[t, t], [t, t]]
    assert layout.segment_at.tolist() == [[[2, 3], [4, 0]], [[0, 0], [0, 0]]]
    assert layout.segment_valid.tolist() == [[[t, t], [t, f]], [[f, f], [f, f]]]
    assert layout.length == 5
    shorter = segment_layout(torch.tensor([[0, 1, 1, -1], [0, 0, 0, 1]]))  # prefixes of 1 and 3 tokens
    assert shorter.prefix_valid.tolist() == [[t, f, f], [t, t, t]]
    assert shorter.segment_at.tolist() == [[[1, 2]], [[3, 0]]]


@pytest.fixture
def segments_always_pay(monkeypatch):
    """The tests' rows are short: take the segment path whatever it saves."""
    monkeypatch.setattr(segments, "SEGMENTS_PAY_FROM", 0)


def layout_of(prefix: int, remainders: list[int], groups: int = 1):
    row = [0] * prefix + [k for k, size in enumerate(remainders, start=1) for _ in range(size)]
    return segment_layout(torch.tensor([row] * groups))


def test_segments_pay_for_many_or_long_remainders_only():
    # dense G·L² against G·(P² + n·S·(P + S)) scores: saved 30,192 / 59,648 / 7,200 / 1,048,576
    assert not segments_pay(layout_of(9, [34] * 4, groups=2))  # the RL benchmark's rows: about even
    assert segments_pay(layout_of(9, [32] * 8))  # 8 samples per prompt
    assert not segments_pay(layout_of(15, [15, 15], groups=8))  # DPO pairs: the masked call is cheaper
    assert segments_pay(layout_of(128, [128] * 8))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_segment_attention_equals_sdpa_under_the_mask(kv_heads):
    ids, mask, _, groups = shared_batch()
    rows = share_prefixes(ids, mask, groups)
    torch.manual_seed(0)
    count, length = rows.input_ids.shape
    query = torch.randn(count, 4, length, 8, requires_grad=True)  # (G, H, L, D)
    key = torch.randn(count, kv_heads, length, 8, requires_grad=True)  # (G, K, L, D)
    value = torch.randn(count, kv_heads, length, 8, requires_grad=True)
    real = rows.segments >= 0  # (G, L)
    upstream = torch.randn(count, length, 4, 8) * real[:, :, None, None]  # gradients only at real tokens

    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=rows.allowed[:, None], scale=0.3, enable_gqa=kv_heads != 4).transpose(1, 2)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    got = segment_attention(query, key, value, segment_layout(rows.segments), 0.3)  # (G, L, H, D)
    got_grads = torch.autograd.grad((got * upstream).sum(), (query, key, value))

    assert torch.allclose(got[real], expected[real], atol=1e-5)
    assert (got[~real] == 0).all()
    for a, b in zip(got_grads, expected_grads):
        assert torch.allclose(a, b, atol=1e-5)
    assert max(float(g.abs().max()) for g in got_grads) > 0


def qwen2(tiny_model_dir):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


@pytest.fixture(params=["llama", "qwen2", "llama-lora"])
def model(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    if request.param == "qwen2":
        return qwen2(tiny_model_dir)
    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    if request.param == "llama":
        return llama
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(llama, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False))


def logprobs_and_grads(model, actions, forward):
    """(B, A) log-probs on the action tokens and the parameter gradients of their sum plus 0.1 x entropy."""
    model.zero_grad()
    logprobs, entropy = forward()
    ((logprobs + 0.1 * entropy) * actions).sum().backward()
    return logprobs * actions, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def test_the_shared_forward_gives_the_separate_logprobs_and_gradients(model, monkeypatch, segments_always_pay):
    calls = []
    real = segments.shared_forward_hidden
    monkeypatch.setattr(sharing, "shared_forward_hidden", lambda *a: calls.append(1) or real(*a))
    ids, mask, actions, groups = shared_batch()
    rows = share_prefixes(ids, mask, groups)

    expected, expected_grads = logprobs_and_grads(model, actions, lambda: token_logprobs(model, ids, mask, actions,
                                                                                        with_entropy=True))
    got, got_grads = logprobs_and_grads(model, actions, lambda: shared_token_logprobs(model, rows, ids, actions,
                                                                                      with_entropy=True))
    assert calls, "the shared forward did not run per segment"
    assert torch.allclose(got, expected, atol=1e-5)
    assert (expected[actions.bool()] < 0).all()
    assert_same_gradients(got_grads, expected_grads, atol=1e-5)


@pytest.mark.parametrize("per_segment", [True, False])
def test_packed_shared_rows_give_the_separate_logprobs_and_gradients(model, monkeypatch, per_segment):
    """``--packing`` with shared prompts: the rows' real tokens as one row (no padding in the
    projections), attention at their places in the rows' layout (per segment, or for rows too
    short for that to pay one masked call), the separate forwards' numbers."""
    from rlhf.fastpaths.packing import PackedModel

    monkeypatch.setattr(segments, "SEGMENTS_PAY_FROM", 0 if per_segment else 10**9)
    shapes = []
    real = segments.shared_forward_hidden
    monkeypatch.setattr(sharing, "shared_forward_hidden",
                        lambda m, ids, *a: shapes.append((tuple(ids.shape), a[3] is None)) or real(m, ids, *a))
    ids, mask, actions, groups = shared_batch()
    rows = share_prefixes(ids, mask, groups)
    packed = PackedModel(model)
    path = "prefix_sharing/packed/" + ("segment" if per_segment else "masked")  # each variant checked on its own
    assert sharing.can_share(packed) and sharing_path(packed, rows) == path

    expected, expected_grads = logprobs_and_grads(model, actions, lambda: token_logprobs(model, ids, mask, actions,
                                                                                        with_entropy=True))
    got, got_grads = logprobs_and_grads(model, actions, lambda: shared_token_logprobs(packed, rows, ids, actions,
                                                                                      with_entropy=True))
    # 4 prompt + 3 + 2 | 4 + 4 + 1 + 2 (rows 2, 3, 7 share 50 51) | 2 + 1 + 3 (row 4 a prefix of 5) | 4
    assert shapes == [((1, 9 + 11 + 5 + 4), per_segment)], "the shared rows did not run packed"
    assert rows.input_ids.numel() > 29  # the padded layout has padding the packed row does not
    assert torch.allclose(got, expected, atol=1e-5)
    assert (expected[actions.bool()] < 0).all()
    assert_same_gradients(got_grads, expected_grads, atol=1e-5)

    # checked once per model, not per wrapper (the fit loop wraps the model anew for every micro-batch)
    def check(wrapper):
        return checked_for_sharing(wrapper, rows,
                                   lambda: shared_token_logprobs(wrapper, rows, ids, actions)[0] * actions,
                                   lambda: token_logprobs(wrapper, ids, mask, actions)[0] * actions, "dpo")

    assert check(packed) and verdict(model, path) is True
    monkeypatch.setattr(sharing, "settle", lambda *a, **k: pytest.fail("checked again"))
    assert check(PackedModel(model))


def test_packed_models_it_does_not_reproduce_run_packed_and_unshared(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.fastpaths.packing import PackedModel

    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert sharing.can_share(eager)  # takes the 4D mask padded
    assert not sharing.can_share(PackedModel(eager))  # packed, no segment forward: its sequences run unshared
    assert sharing.can_share(PackedModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                              attn_implementation="sdpa")))


def test_models_it_does_not_reproduce_run_their_own_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    assert segment_forward_supported(llama)
    assert not segment_forward_supported(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                              attn_implementation="eager"))
    llama.gradient_checkpointing_enable()
    assert not segment_forward_supported(llama)  # its layers would recompute with their own attention
    dropping = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa", attention_dropout=0.1)
    assert not segment_forward_supported(dropping.train())
    assert segment_forward_supported(dropping.eval())


def test_a_data_parallel_wrapper_runs_the_masked_forward(tiny_model_dir, monkeypatch, segments_always_pay):
    from transformers import AutoModelForCausalLM

    class Wrapper(torch.nn.Module):  # as DDP and DeepSpeed's engine hold the model: its forward must run
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    monkeypatch.setattr(sharing, "shared_forward_hidden", lambda *a: pytest.fail("bypassed the wrapper"))
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    ids, mask, actions, groups = shared_batch()
    got, _ = shared_token_logprobs(Wrapper(lm), share_prefixes(ids, mask, groups), ids, actions)
    expected, _ = token_logprobs(lm, ids, mask, actions)
    assert torch.allclose(got * actions, expected * actions, atol=1e-5)


def test_a_wrong_segment_forward_is_caught_and_run_separately(tiny_model_dir, monkeypatch, caplog,
                                                            segments_always_pay):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    real = segments.segment_attention
    monkeypatch.setattr(segments, "segment_attention", lambda *a: real(*a) * 0.5)  # a bug in the attention
    ids, mask, actions, groups = shared_batch()
    rows = share_prefixes(ids, mask, groups)
    with caplog.at_level("WARNING"):
        used = checked_for_sharing(lm, rows, lambda: shared_token_logprobs(lm, rows, ids, actions)[0] * actions,
                                   lambda: token_logprobs(lm, ids, mask, actions)[0] * actions, "train")
    assert not used
    assert "the fast path prefix_sharing/segment differs from the plain path" in caplog.text


def test_each_sharing_path_is_checked_where_it_first_runs(tiny_model_dir, monkeypatch, caplog):
    """The masked forward agreeing says nothing of the segment forward: micro-batches too short for
    segments to pay take the masked one, longer ones the segment one, each checked on its own."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    real = segments.segment_attention
    monkeypatch.setattr(segments, "segment_attention", lambda *a: real(*a) * 0.5)  # a bug in the segment path
    ids, mask, actions, groups = shared_batch()
    rows = share_prefixes(ids, mask, groups)

    def check():
        return checked_for_sharing(lm, rows, lambda: shared_token_logprobs(lm, rows, ids, actions)[0] * actions,
                                   lambda: token_logprobs(lm, ids, mask, actions)[0] * actions, "train")

    assert sharing_path(lm, rows) == "prefix_sharing/masked"  # short rows: segments do not pay
    assert check() and verdict(lm, "prefix_sharing/masked") is True
    monkeypatch.setattr(segments, "SEGMENTS_PAY_FROM", 0)  # as for a longer micro-batch
    assert sharing_path(lm, rows) == "prefix_sharing/segment"
    with caplog.at_level("WARNING"):
        assert not check()
    assert verdict(lm, "prefix_sharing/segment") is False and verdict(lm, "prefix_sharing/masked") is True
    assert "prefix_sharing/segment differs" in caplog.text
