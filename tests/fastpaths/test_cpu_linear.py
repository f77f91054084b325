"""oneDNN linear layers (`rlhf.fastpaths.cpu_linear`) give nn.Linear's outputs and gradients, take the
oneDNN path only where they should, and reach every model the hf adapter loads on a CPU."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from rlhf.fastpaths import cpu_linear
from rlhf.fastpaths.verdicts import verdict
from rlhf.fastpaths.cpu_linear import ONEDNN_FROM, OneDnnLinear, use_onednn_linears
from rlhf.core.errors import ConfigError
from rlhf.core.logprobs import token_logprobs
from rlhf.plugins.models.hf import HFModelAdapter, HFModelConfig

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch has no oneDNN kernels")


def pair(in_features: int, out_features: int, *, bias: bool, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(in_features, out_features, bias=bias)
    fast = copy.deepcopy(plain)
    assert use_onednn_linears(fast, "onednn") == 1 and type(fast) is OneDnnLinear
    return plain, fast


def grads(layer: nn.Linear, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_(True)
    layer.zero_grad()
    out = layer(x)
    out.backward(upstream)
    return out.detach(), [x.grad] + [p.grad for p in layer.parameters() if p.requires_grad]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(96, 128), (3, 40, 128)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [128, 200])  # square and not: a transposed weight would show
def test_outputs_and_gradients_equal_nn_linear(shape, bias, out_features):
    plain, fast = pair(128, out_features, bias=bias)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=generator)
    upstream = torch.randn(*shape[:-1], out_features, generator=generator)
    assert x.numel() // 128 * 128 * out_features >= ONEDNN_FROM  # the oneDNN path, not the fallback
    want, want_grads = grads(plain, x, upstream)
    got, got_grads = grads(fast, x, upstream)
    assert got.shape == want.shape and close(got, want)
    assert len(got_grads) == len(want_grads) == 2 + bias
    for g, w in zip(got_grads, want_grads):
        assert g.shape == w.shape and close(g, w)
    assert (got - want).abs().max() < 1e-4  # MKL's and oneDNN's sums differ in rounding only


@pytest.mark.unit
def test_strided_inputs_frozen_weights_and_no_grad():
    plain, fast = pair(128, 256, bias=True)
    x = torch.randn(128, 64).t()  # (64, 128), not contiguous
    upstream = torch.randn(64, 256)
    for layer in (plain, fast):
        layer.requires_grad_(False)  # a frozen base weight (LoRA, the reference): only ∂x flows
    want, (want_dx,) = grads(plain, x, upstream)
    got, (got_dx,) = grads(fast, x, upstream)
    assert close(got, want) and close(got_dx, want_dx)
    with torch.no_grad():
        assert close(fast(x), plain(x))
    with torch.inference_mode():
        assert close(fast(x), plain(x))


@pytest.mark.unit
@pytest.mark.parametrize("reduce", ["sum", "strided"])
def test_upstream_gradients_that_are_expanded_or_strided(reduce):
    """out.sum() hands backward a stride-0 gradient, a slice a strided one."""
    plain, fast = pair(128, 256, bias=True)
    x = torch.randn(4, 40, 128)
    results = []
    for layer in (plain, fast):
        leaf = x.clone().requires_grad_(True)
        out = layer(leaf)
        (out.sum() if reduce == "sum" else out[:, ::2, 3:].mean()).backward()
        results.append([leaf.grad, layer.weight.grad, layer.bias.grad])
    for got, want in zip(results[1], results[0]):
        assert close(got, want)


@pytest.mark.unit
@pytest.mark.parametrize("bias", [False, True])
def test_the_weight_gets_its_gradient_when_the_input_needs_none(monkeypatch, bias):
    """The first layer after a frozen embedding (or a LoRA A matrix behind frozen layers): the input
    needs no gradient, the weight does. oneDNN's private op has no autograd kernel, so such a call
    must still go through the autograd function, whose backward must give ∂W (and ∂b) equal to
    nn.Linear's, and compute no ∂x."""
    products = []
    real = cpu_linear.onednn_product
    monkeypatch.setattr(cpu_linear, "onednn_product", lambda *args: products.append(1) or real(*args))
    plain, fast = pair(128, 256, bias=bias)
    embedding = nn.Embedding(300, 128).requires_grad_(False)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (4, 40), generator=generator)  # (B, T): 160 rows, 160·256·128 > 2^20
    upstream = torch.randn(4, 40, 256, generator=generator)  # (B, T, N)
    results = []
    for layer in (plain, fast):
        x = embedding(ids)  # (B, T, K), needs no gradient
        assert not x.requires_grad
        layer(x).backward(upstream)
        results.append([p.grad for p in layer.parameters()])
    assert len(products) == 3  # the first call's check against F.linear, oneDNN's forward and ∂W; no ∂x
    assert len(results[1]) == 1 + bias
    for got, want in zip(results[1], results[0]):
        assert got is not None and close(got, want)


@pytest.mark.unit
def test_a_second_derivative_is_an_error_not_a_wrong_number():
    _, fast = pair(128, 128, bias=False)
    x = torch.randn(64, 128, requires_grad=True)
    (grad,) = torch.autograd.grad(fast(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@pytest.mark.unit
def test_which_calls_take_onednn(monkeypatch):
    taken = []
    real = cpu_linear._OneDnnLinearFunction.apply
    monkeypatch.setattr(cpu_linear._OneDnnLinearFunction, "apply", lambda *a: taken.append(1) or real(*a))
    _, fast = pair(128, 128, bias=False)
    big = torch.randn(64, 128, requires_grad=True)  # 64·128·128 = 2^20 multiply-adds: the threshold
    fast(big)
    assert taken == [1]
    fast(torch.randn(63, 128, requires_grad=True))  # below it: MKL's call is cheaper
    assert taken == [1]
    fast.double()
    fast(big.double())  # float64 keeps nn.Linear's own forward
    assert taken == [1]
    fast.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast(big).dtype == torch.bfloat16  # autocast still casts: nn.Linear's path
    assert taken == [1]
    fast.weight.ds_id = 7  # a DeepSpeed ZeRO-3 partition: DeepSpeed's linear
    fast(big)
    assert taken == [1]
    _, wide = pair(128, 512, bias=False)  # the count is M·N·K, N ≠ K
    wide(torch.randn(16, 128, requires_grad=True))  # 16·512·128 = 2^20
    assert taken == [1, 1]


@pytest.mark.unit
def test_only_plain_linear_layers_change_and_modes_are_checked(monkeypatch):
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.Sequential(nn.Linear(4, 2)), nn.ReLU())
    assert use_onednn_linears(copy.deepcopy(model), "torch") == 0
    assert use_onednn_linears(model, "onednn") == 2
    assert [type(m).__name__ for m in model.modules()] == ["Sequential", "OneDnnLinear", "Custom", "Sequential",
                                                            "OneDnnLinear", "ReLU"]
    monkeypatch.setattr(cpu_linear, "onednn_pays", lambda: False)
    assert use_onednn_linears(nn.Linear(4, 4), "auto") == 0
    monkeypatch.setattr(cpu_linear, "onednn_pays", lambda: True)
    assert use_onednn_linears(nn.Linear(4, 4), "auto") == 1
    with pytest.raises(ConfigError, match="--cpu-linear must be one of auto, onednn, torch; got 'mkl'"):
        use_onednn_linears(model, "mkl")
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="no oneDNN"):
        cpu_linear.check_mode("onednn")


@pytest.mark.unit
@pytest.mark.parametrize("vendor, capability, pays", [("AuthenticAMD", "AVX512", True), ("GenuineIntel", "AVX512", False),
                                                      ("AuthenticAMD", "AVX2", False), ("", "AVX512", False)])
def test_auto_means_an_avx512_cpu_not_made_by_intel(monkeypatch, vendor, capability, pays):
    monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    cpu_linear.onednn_pays.cache_clear()
    try:
        assert cpu_linear.onednn_pays() is pays
    finally:
        cpu_linear.onednn_pays.cache_clear()


@pytest.mark.unit
def test_the_vendor_is_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    assert cpu_linear._cpu_vendor(str(cpuinfo)) == "AuthenticAMD"
    assert cpu_linear._cpu_vendor(str(tmp_path / "missing")) == ""


@pytest.mark.unit
def test_the_adapter_gives_a_model_the_same_logprobs_and_gradients(tiny_model_dir):
    """The tiny Llama (hidden 64, MLP 256) on 6 x 24 tokens: its MLP products take oneDNN."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 300, (6, 24), generator=generator)  # (B, T)
    mask = torch.ones_like(ids)
    action_mask = torch.ones(6, 23)
    outputs = {}
    for mode in ("torch", "onednn"):
        adapter = HFModelAdapter(HFModelConfig(device="cpu", cpu_linear=mode))
        model = adapter.load(str(tiny_model_dir), role="policy")
        count = sum(isinstance(m, OneDnnLinear) for m in model.modules())
        assert count == (0 if mode == "torch" else 2 * 7 + 1)  # q k v o gate up down per layer, lm_head
        logprobs, _ = token_logprobs(model, ids, mask, action_mask)  # (B, T - 1)
        (logprobs * action_mask).sum().backward()
        outputs[mode] = logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}
        reference = adapter.load(str(tiny_model_dir), role="reference")
        assert sum(isinstance(m, OneDnnLinear) for m in reference.modules()) == count
    (want, want_grads), (got, got_grads) = outputs["torch"], outputs["onednn"]
    assert torch.allclose(got, want, atol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        assert close(got_grads[name], grad), name


@pytest.mark.unit
def test_lora_matrices_behind_frozen_layers_get_nn_linears_gradients(tiny_model_dir, monkeypatch):
    """With LoRA the embeddings and norms are frozen: the first layer's A matrices see an input that
    needs no gradient while their weights train. Rank 64 on 8 x 40 tokens puts their products
    (320·64·64 multiply-adds) on the oneDNN path; every LoRA gradient equals the torch model's."""
    inputs_needing_grad = []
    real = cpu_linear._OneDnnLinearFunction.apply
    monkeypatch.setattr(cpu_linear._OneDnnLinearFunction, "apply",
                        lambda x, *rest: inputs_needing_grad.append(x.requires_grad) or real(x, *rest))
    ids = torch.randint(5, 300, (8, 40), generator=torch.Generator().manual_seed(3))  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)
    action_mask = torch.ones(8, 39)  # (B, A)
    gradients = {}
    for mode in ("torch", "onednn"):
        torch.manual_seed(0)  # the same LoRA A matrices in both models
        model = HFModelAdapter(HFModelConfig(device="cpu", cpu_linear=mode, lora_rank=64)).load(
            str(tiny_model_dir), role="policy")
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B starts at 0, which would give every A a zero gradient
            for name, weight in model.named_parameters():
                if "lora_B" in name:
                    weight.copy_(0.1 * torch.randn(weight.shape, generator=generator))
        logprobs, _ = token_logprobs(model, ids, mask, action_mask)  # (B, A)
        (logprobs * action_mask).sum().backward()
        gradients[mode] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert False in inputs_needing_grad and True in inputs_needing_grad  # both kinds of call took oneDNN
    assert gradients["torch"].keys() == gradients["onednn"].keys() and gradients["torch"]
    for name, grad in gradients["torch"].items():
        assert float(grad.abs().max()) > 0, name
        assert gradients["onednn"][name] is not None and close(gradients["onednn"][name], grad), name


@pytest.mark.unit
def test_unknown_mode_is_a_config_error_before_loading():
    with pytest.raises(ConfigError, match="--cpu-linear must be one of"):
        HFModelAdapter(HFModelConfig(device="cpu", cpu_linear="fast"))


@pytest.mark.run
def test_the_cli_flag_reaches_the_models_and_the_run_matches(tiny_model_dir, task, tmp_path, plugins, monkeypatch):
    """`rlhf train --cpu-linear onednn|torch`: the policy's training products go through oneDNN or
    not, and one step's metrics agree to float rounding."""
    from tests.helpers import run_cli

    rewards = tmp_path / "dense.py"  # every sample a different reward: the step has a real loss and gradient
    rewards.write_text("def dense(completions, **kwargs):\n    return [sum(map(ord, c)) % 97 / 97 for c in completions]\n")
    calls = []
    real = cpu_linear._OneDnnLinearFunction.apply
    monkeypatch.setattr(cpu_linear._OneDnnLinearFunction, "apply", lambda *a: calls.append(1) or real(*a))
    metrics = {}
    for mode in ("torch", "onednn"):
        calls.clear()
        out = tmp_path / mode
        result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                                   "--reward", f"{rewards}:dense", "--lr", "1e-3",
                                   "--n-samples", "4", "--prompts-per-step", "4", "--max-new-tokens", "8",
                                   "--steps", "1", "--out", str(out), "--no-progress", "--threads", "1",
                                   "--cpu-linear", mode])
        assert result.exit_code == 0, result.output
        assert bool(calls) == (mode == "onednn")
        metrics[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert metrics["torch"]["policy/grad_norm"] > 1e-3 and metrics["torch"]["reward/std"] > 0
    for key in ("reward/mean", "policy/loss", "policy/grad_norm", "response/length_mean"):
        assert metrics["onednn"][key] == pytest.approx(metrics["torch"][key], rel=1e-4, abs=1e-7), key


@pytest.mark.unit
def test_an_unknown_cli_value_is_one_line(tiny_model_dir, task, tmp_path, plugins):
    from tests.helpers import run_cli

    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--label-key", "answer", "--reward", "examples/rewards.py:exact_match",
                               "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress", "--cpu-linear", "mkl"])
    assert result.exit_code == 2, result.output
    assert "--cpu-linear must be one of auto, onednn, torch; got 'mkl'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.unit
def test_a_layer_whose_onednn_product_differs_goes_back_to_nn_linear(monkeypatch, caplog):
    plain, fast = pair(128, 256, bias=True)
    x = torch.randn(64, 128)
    real = cpu_linear.onednn_product
    monkeypatch.setattr(cpu_linear, "onednn_product", lambda *args: real(*args) * 1.01)  # a wrong kernel
    with caplog.at_level("WARNING"):
        got = fast(x)
    assert type(fast) is nn.Linear and verdict(fast, "cpu_linear") is False
    assert torch.equal(got, plain(x)) and torch.equal(fast(x), plain(x))
    assert "the fast path cpu_linear differs from the plain path" in caplog.text and "--cpu-linear torch" in caplog.text
    _, agreeing = pair(128, 256, bias=True)
    monkeypatch.undo()
    agreeing(x)
    assert type(agreeing) is OneDnnLinear and verdict(agreeing, "cpu_linear") is True

