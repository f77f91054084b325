"""Mixture-of-experts policies for the ``vllm`` engine: transformers 5 holds a layer's experts as
fused 3D tensors, vLLM's ``load_weights`` takes the checkpoint's one matrix per expert. The sent
weights must be the checkpoint's (what ``save_pretrained`` writes, names and values) and route to
every parameter of vLLM's model (`fakes.MoENameLoader`, vLLM's naming rules)."""

from __future__ import annotations

import pytest
import torch

from rlhf.plugins.engines.vllm_weights import bucket_by_bytes, map_state_dict, policy_weights
from tests.helpers import tiny_moe
from tests.vllm.fakes import MoENameLoader

pytestmark = pytest.mark.unit


def fused_experts() -> bool:
    """transformers 5 holds a layer's experts fused; transformers 4 as the checkpoint does."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def small_moe(kind: str) -> torch.nn.Module:
    return tiny_moe(kind, vocab=48, hidden=16, experts=3)


def saved_checkpoint(model: torch.nn.Module, directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model.save_pretrained(directory)
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_expert_weights_go_out_as_the_checkpoint_holds_them(kind, tmp_path):
    model = small_moe(kind)
    fused = any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())
    assert fused == fused_experts()  # transformers 5: the module's layout is not the checkpoint's
    sent = dict(policy_weights(model))
    checkpoint = saved_checkpoint(model, tmp_path)
    assert sorted(sent) == sorted(checkpoint)
    for name, tensor in sent.items():
        assert torch.equal(tensor, checkpoint[name]), name
    # under DeepSpeed's and peft's wrappers' names, and from a state dict (the Ray runtime's path)
    state = {f"module.{name}": p.detach() for name, p in model.named_parameters()}
    from_state = dict(map_state_dict(state, model))
    assert sorted(from_state) == sorted(checkpoint)
    assert all(torch.equal(from_state[name], checkpoint[name]) for name in checkpoint)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_every_sent_name_is_one_vllm_loads_and_every_expert_shard_arrives_once(kind):
    model = small_moe(kind)
    names = [name for bucket in bucket_by_bytes(policy_weights(model), 4096) for name, _ in bucket]
    loader = MoENameLoader(kind, layers=2, experts=3)
    loaded = loader.load(names)  # KeyError on a name vLLM's model lacks
    assert len(loaded) == len(set(loaded)) == len(names)
    assert {param for param, _ in loaded} == loader.params
    gate, up, down = loader.expert_names
    for layer in range(2):
        block = "block_sparse_moe" if kind == "mixtral" else "mlp"
        w13 = {shard for param, shard in loaded if param == f"model.layers.{layer}.{block}.experts.w13_weight"}
        w2 = {shard for param, shard in loaded if param == f"model.layers.{layer}.{block}.experts.w2_weight"}
        assert w13 == {(e, name) for e in range(3) for name in (gate, up)} and w2 == {(e, down) for e in range(3)}


@pytest.mark.skipif(not fused_experts(), reason="transformers 4 keeps one module per expert")
def test_the_per_expert_matrices_are_the_fused_tensor_s_halves():
    """Mixtral's w1 (gate) is the first half of gate_up_proj's rows, w3 (up) the second, w2 down_proj's."""
    model = small_moe("mixtral")
    sent = dict(policy_weights(model))
    experts = model.model.layers[1].mlp.experts
    half = experts.gate_up_proj.shape[1] // 2
    prefix = "model.layers.1.block_sparse_moe.experts.2"
    assert torch.equal(sent[f"{prefix}.w1.weight"], experts.gate_up_proj[2, :half].detach())
    assert torch.equal(sent[f"{prefix}.w3.weight"], experts.gate_up_proj[2, half:].detach())
    assert torch.equal(sent[f"{prefix}.w2.weight"], experts.down_proj[2].detach())
    assert torch.equal(sent["model.layers.1.block_sparse_moe.gate.weight"], model.model.layers[1].mlp.gate.weight)
