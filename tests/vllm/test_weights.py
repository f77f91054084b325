"""Weights for the ``vllm`` engine: checkpoint names, merged LoRA, buckets, change detection,
and the process-group transport (two CPU processes over gloo)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.api import weight_checksum
from rlhf.core.distributed import DistContext, exit_process
from rlhf.core.errors import ConfigError
from rlhf.plugins.engines.vllm_weights import (bucket_by_bytes, map_state_dict, policy_version, policy_weights,
                                               receive_weights, send_weights, vllm_weight_name)


@pytest.mark.unit
@pytest.mark.parametrize("name, expected", [
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),  # DeepSpeed / DDP
    ("_orig_mod.module.lm_head.weight", "lm_head.weight"),  # torch.compile around DDP
    ("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", "model.layers.0.mlp.up_proj.weight"),  # peft
    ("module.base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("base_model.model.lm_head.original_module.weight", None),
    ("model.layers.0._checkpoint_wrapped_module.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
    ("model.norm.weight", "model.norm.weight"),
])
def test_checkpoint_names(name, expected):
    assert vllm_weight_name(name) == expected


@pytest.mark.unit
def test_adapter_tensors_must_be_merged_first():
    with pytest.raises(ConfigError, match="LoRA adapter tensor"):
        vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")


@pytest.mark.unit
def test_state_dict_names_are_mapped_in_order():
    state = {"module.model.norm.weight": torch.ones(2), "module.lm_head.original_module.weight": torch.zeros(1),
             "module.lm_head.modules_to_save.default.weight": torch.full((1,), 3.0)}
    got = list(map_state_dict(state))
    assert [name for name, _ in got] == ["model.norm.weight", "lm_head.weight"]
    assert got[1][1].item() == 3.0


def llama(tie: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=24, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


@pytest.mark.unit
def test_a_plain_model_sends_its_parameters_under_their_own_names():
    model = llama()
    sent = list(policy_weights(model))
    assert [name for name, _ in sent] == [name for name, _ in model.named_parameters()]
    for (_, tensor), (_, param) in zip(sent, model.named_parameters()):
        assert tensor.data_ptr() == param.data_ptr()  # no copy for plain parameters


@pytest.mark.unit
def test_tied_weights_are_sent_once():
    model = llama(tie=True)
    names = [name for name, _ in policy_weights(model)]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    assert names == [name for name, _ in model.named_parameters()]


def lora_policy(**extra):
    import peft

    model = llama()
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = peft.LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "down_proj"], **extra)
    lora = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:  # B starts at zero; give the adapter something to merge
                param.copy_(torch.randn(param.shape, generator=generator))
    return lora, base


@pytest.mark.unit
def test_lora_layers_are_sent_merged():
    lora, base = lora_policy()
    before = {name: p.detach().clone() for name, p in lora.named_parameters()}
    sent = dict(policy_weights(lora))
    assert list(sent) == list(base)  # the base model's names, nothing of the adapter
    layer = lora.base_model.model.model.layers[1].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r, in), (out, r)
    expected = base["model.layers.1.self_attn.q_proj.weight"] + (8 / 2) * b @ a  # W + (α/r)·B A
    torch.testing.assert_close(sent["model.layers.1.self_attn.q_proj.weight"], expected)
    assert not torch.equal(expected, base["model.layers.1.self_attn.q_proj.weight"])
    torch.testing.assert_close(sent["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    # peft's own merge agrees, and the policy was not touched
    merged = copy.deepcopy(lora).merge_and_unload().state_dict()
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name])
    for name, param in lora.named_parameters():
        assert torch.equal(param, before[name]), name


@pytest.mark.unit
def test_lora_with_the_adapter_switched_off_sends_the_base_weights():
    lora, base = lora_policy()
    with lora.disable_adapter():
        sent = dict(policy_weights(lora))
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, base[name])


@pytest.mark.unit
def test_modules_to_save_sends_the_trained_copy():
    lora, base = lora_policy(modules_to_save=["lm_head"])
    with torch.no_grad():
        lora.base_model.model.lm_head.modules_to_save["default"].weight.fill_(0.5)
    sent = dict(policy_weights(lora))
    assert list(sent) == list(base)
    assert torch.all(sent["lm_head.weight"] == 0.5)


@pytest.mark.run
def test_version_changes_with_in_place_writes_only():
    model = llama()
    start = policy_version(model)
    model(torch.tensor([[1, 2, 3]]))
    assert policy_version(model) == start  # a forward writes nothing
    model.load_state_dict(llama(seed=1).state_dict())
    loaded = policy_version(model)
    assert loaded != start
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    assert policy_version(model) != loaded


# --- buckets ---------------------------------------------------------------------------------


def floats(*sizes):
    return [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]  # float32: 4 bytes each


@pytest.mark.unit
def test_buckets_by_hand():
    named = floats(3, 2, 5, 1, 1)  # 12, 8, 20, 4, 4 bytes
    names = lambda buckets: [[n for n, _ in bucket] for bucket in buckets]  # noqa: E731
    assert names(bucket_by_bytes(named, 16)) == [["t0"], ["t1"], ["t2"], ["t3", "t4"]]  # 20 > 16 goes alone
    assert names(bucket_by_bytes(named, 24)) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert names(bucket_by_bytes(named, 1000)) == [["t0", "t1", "t2", "t3", "t4"]]
    assert list(bucket_by_bytes([], 8)) == []


@pytest.mark.unit
def test_buckets_are_made_lazily():
    pulled = []

    def source():
        for name, tensor in floats(1, 1, 1, 1):
            pulled.append(name)
            yield name, tensor

    first = next(bucket_by_bytes(source(), 8))
    assert [n for n, _ in first] == ["t0", "t1"] and pulled == ["t0", "t1", "t2"]  # one look-ahead


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), max_size=30), max_bytes=st.integers(1, 120))
def test_buckets_keep_every_tensor_once_in_order_and_bounded(sizes, max_bytes):
    named = floats(*sizes)
    buckets = list(bucket_by_bytes(named, max_bytes))
    flat = [item for bucket in buckets for item in bucket]
    assert [n for n, _ in flat] == [n for n, _ in named]
    for bucket in buckets:
        total = sum(t.numel() * 4 for _, t in bucket)
        assert bucket and (total <= max_bytes or len(bucket) == 1)


# --- across processes ------------------------------------------------------------------------


def _exchange(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 0:
            sent = send_weights(policy_weights(llama(seed=3)), group=None, src=0, max_bytes=600)
            torch.save({"sent": sent}, out + ".sender")
        else:
            checksums = {}
            buckets = list(receive_weights(group=None, src=0, device="cpu", sent_checksums=checksums))
            torch.save({"buckets": [[(n, t) for n, t in b] for b in buckets], "checksums": checksums}, out)
    finally:
        DistContext(rank=rank, world_size=2).close()
    exit_process(0)  # a worker of a process group ends without the interpreter's teardown, as rlhf's do


@pytest.mark.cluster
def test_weights_travel_over_a_process_group(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "received.pt")
    mp.spawn(_exchange, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    buckets, checksums = torch.load(out)["buckets"], torch.load(out)["checksums"]
    expected = list(policy_weights(llama(seed=3)))
    received = [item for bucket in buckets for item in bucket]
    assert [n for n, _ in received] == [n for n, _ in expected]
    for (_, got), (_, want) in zip(received, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert len(buckets) == len(list(bucket_by_bytes(expected, 600))) > 1
    assert torch.load(out + ".sender")["sent"] == sum(t.numel() * t.element_size() for _, t in expected)
    assert checksums == {name: weight_checksum(t) for name, t in expected}  # the sender's, for the receiver to compare
    assert os.path.exists(out)
