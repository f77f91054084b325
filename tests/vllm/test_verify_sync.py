"""Every weight sync to the ``vllm`` engine is verified (on by default): a tensor vLLM's model drops
or corrupts after the first sync (the MoE failure: experts left stale) stops the run with one line
naming it; a hung sync hits --weight-sync-timeout-s with one line; normal syncs pass."""

from __future__ import annotations

import time

import pytest
import torch

from rlhf.core.protocols.rollout import SamplingParams
from rlhf.core.weight_check import WeightSyncError, WeightSyncTimeout
from tests.vllm import fakes
from tests.vllm.fakes import make_engine

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.95, return_logprobs=True)
DROPPED = "model.layers.1.mlp.down_proj.weight"


def train_a_step(model):
    with torch.no_grad():  # what an optimizer step does: every parameter written in place
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 1e-3)


def vllm_model():
    return fakes.FakeLLM.instances[0].worker.model


def test_syncs_pass_and_vllm_holds_the_policy(fake_vllm, policy):
    model = policy[0]
    engine = make_engine(policy, sync_bucket_mb=0.05)  # several buckets
    for _ in range(3):
        engine.generate([[5]], n=1, params=PARAMS)
        train_a_step(model)
    engine.load_weights(None)
    held = vllm_model().params
    for name, param in model.named_parameters():
        assert torch.equal(held[name], param), name


@pytest.mark.parametrize("fault", ["drop", "corrupt"])
def test_a_tensor_lost_after_the_first_sync_stops_the_run_naming_it(fake_vllm, policy, fault):
    model = policy[0]
    engine = make_engine(policy, sync_bucket_mb=0.05)
    setattr(vllm_model(), fault, {DROPPED})
    engine.load_weights(None)  # the first sync is sound
    train_a_step(model)
    with pytest.raises(WeightSyncError) as caught:
        engine.load_weights(None)
    message = str(caught.value)
    assert "\n" not in message and DROPPED in message and "--no-verify-weight-sync" in message
    assert ("never loaded" if fault == "drop" else "holds other values") in message
    assert sum(name in message for name, _ in model.named_parameters()) == 1  # that tensor only
    with pytest.raises(WeightSyncError):  # never samples from them: the next generation syncs (and fails) again
        engine.generate([[5]], n=1, params=PARAMS)


def test_the_check_can_be_turned_off(fake_vllm, policy):
    model = policy[0]
    engine = make_engine(policy, verify_weight_sync=False)
    vllm_model().drop = {DROPPED}
    engine.load_weights(None)
    train_a_step(model)
    engine.load_weights(None)  # unnoticed: what the check exists for
    assert not torch.equal(vllm_model().params[DROPPED], dict(model.named_parameters())[DROPPED])


def test_a_fused_parameter_is_checked_as_the_sum_of_its_parts(fake_vllm, policy):
    """vLLM fuses q/k/v into one ``qkv_proj`` whose loader writes each part's rows: the fused parameter
    must hold exactly its parts; a stale part (k here) is named with the parameter holding it."""
    model = policy[0]
    engine = make_engine(policy)
    fused = vllm_model()
    layer = "model.layers.0.self_attn."
    parts = {p: fused.params.pop(f"{layer}{p}_proj.weight") for p in ("q", "k", "v")}
    rows = {p: t.shape[0] for p, t in parts.items()}
    qkv = torch.nn.Parameter(torch.zeros(sum(rows.values()), parts["q"].shape[1]), requires_grad=False)
    fused.params[f"{layer}qkv_proj.weight"] = qkv
    plain_load = fused.load_weights
    stale = []

    def fused_load(weights):
        rest = []
        for name, tensor in weights:
            part = name.removeprefix(layer).removesuffix("_proj.weight")
            if not name.startswith(layer) or part not in rows:
                rest.append((name, tensor))
                continue
            if part in stale:
                continue
            loader = getattr(qkv, "weight_loader", fakes.default_weight_loader)
            loader(qkv, tensor, part)  # vLLM's QKVParallelLinear.weight_loader(param, loaded, shard_id)
        plain_load(rest)

    def qkv_loader(param, loaded, shard):
        start = {"q": 0, "k": rows["q"], "v": rows["q"] + rows["k"]}[shard]
        param.data[start:start + loaded.shape[0]].copy_(loaded)

    qkv.weight_loader = qkv_loader
    fused.load_weights = fused_load
    engine.load_weights(None)
    assert torch.equal(qkv, torch.cat([dict(model.named_parameters())[f"{layer}{p}_proj.weight"] for p in "qkv"]))
    train_a_step(model)
    engine.load_weights(None)
    stale.append("k")
    train_a_step(model)
    with pytest.raises(WeightSyncError, match=rf"{layer}k_proj.weight was sent but vLLM's load_weights never"):
        engine.load_weights(None)
    stale.clear()
    qkv.weight_loader = lambda param, loaded, shard: qkv_loader(param, loaded * (2 if shard == "v" else 1), shard)
    with pytest.raises(WeightSyncError, match=rf"{layer}q_proj.weight, {layer}k_proj.weight, {layer}v_proj.weight "
                                              rf"\(held in vLLM's {layer}qkv_proj.weight\) holds other values"):
        engine.load_weights(None)  # a loader that writes other values than it was given


def test_a_hung_sync_hits_the_timeout_with_one_line(fake_vllm, policy):
    model = policy[0]
    engine = make_engine(policy, weight_sync_timeout_s=0.5)
    engine.load_weights(None)
    vllm_model().hang = True
    train_a_step(model)
    began = time.monotonic()
    with pytest.raises(WeightSyncTimeout) as caught:
        engine.load_weights(None)
    assert time.monotonic() - began < 10
    message = str(caught.value)
    assert "\n" not in message and "within 0.5 s (--weight-sync-timeout-s)" in message
    vllm_model().hang = False
    llm = fakes.FakeLLM.instances[0]
    calls = len(llm.calls)
    engine.generate([[5]], n=1, params=PARAMS)  # a half-loaded model is never sampled from: synced again first
    assert llm.calls[calls:] == ["collective_rpc", "reset_prefix_cache", "generate"]


def test_weights_from_another_process_are_compared_with_the_senders_checksums(fake_vllm, policy):
    """``load_weights_from_group``: the sender's checksums come with the end of the sync
    (``send_weights``); what arrived must match them (a bit flipped on the way is named)."""
    from rlhf.api import weight_checksum
    from rlhf.plugins.engines.vllm_weights import bucket_by_bytes, policy_weights

    engine = make_engine(policy)
    named = list(policy_weights(policy[0]))
    sender = {name: weight_checksum(tensor) for name, tensor in named}
    engine._push(bucket_by_bytes(named, 2**20), sender=dict(sender))  # sound
    flipped = [(name, tensor.clone()) for name, tensor in named]
    flipped[3][1].view(-1)[0] += 1.0  # damaged on the way
    with pytest.raises(WeightSyncError, match=rf"{flipped[3][0]} arrived with other values than the trainer sent"):
        engine._push(bucket_by_bytes(flipped, 2**20), sender=dict(sender))
