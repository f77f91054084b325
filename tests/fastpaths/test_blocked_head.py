"""The decode's output layer as blocks of W·hᵀ (rlhf/fastpaths/blocked_head.py):

* its logits equal the layer's own forward (to float rounding; the same bits where MKL sums in
  the same order), for vocabularies that end inside a block and any row count it is taken for;
* it is taken only where it pays and can run (16-128 rows, a large float32 weight without a bias
  on a CPU, MKL's product the layer's own);
* the engine's lean step with it samples what the direct decoder and the lean step without it
  sample, is checked against the forward under a variant name of its own, and a variant that
  differs is caught and decodes through the forward.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from rlhf.core.protocols.rollout import SamplingParams
from rlhf.fastpaths import blocked_head as blocked_head_module
from rlhf.fastpaths import packed_head as packed_head_module
from rlhf.fastpaths.blocked_head import BLOCK, MAX_ROWS, MIN_ROWS, BlockedHead, blocked_head
from rlhf.fastpaths.cpu_linear import OneDnnLinear, onednn_available
from rlhf.fastpaths.verdicts import verdict
from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig

needs_mkl = pytest.mark.skipif(not packed_head_module._mkl_available(), reason="this torch has no MKL")


def head(vocab=4 * BLOCK + 100, hidden=1024, bias=False, cls=nn.Linear):
    torch.manual_seed(0)
    layer = nn.Linear(hidden, vocab, bias=bias)  # 4.3M weight elements, the last block 100 entries
    layer.__class__ = cls
    return layer


@pytest.mark.unit
@needs_mkl
@pytest.mark.parametrize("rows", [MIN_ROWS, 33, MAX_ROWS])
def test_the_blocks_give_the_layer_s_own_logits(rows):
    layer = head().requires_grad_(True)  # a policy's output layer: the decode builds no graph on it
    blocked = blocked_head(layer, rows)
    assert isinstance(blocked, BlockedHead)
    x = torch.randn(rows, 1, layer.in_features)  # (B, 1, H)
    with torch.no_grad():
        expected = layer(x)  # (B, 1, V)
    got = blocked(x)
    assert got.shape == expected.shape == (rows, 1, layer.out_features) and not got.requires_grad
    assert float((got - expected).abs().max()) <= 1e-6 * float(expected.abs().max())


@pytest.mark.unit
@needs_mkl
def test_every_step_writes_its_logits_into_the_decode_s_one_buffer():
    layer = head()
    blocked = blocked_head(layer, 24)
    torch.manual_seed(1)
    first_x, second_x = torch.randn(24, 1, layer.in_features), torch.randn(24, 1, layer.in_features)
    first = blocked(first_x)
    kept = first.clone()
    second = blocked(second_x)
    assert second.data_ptr() == first.data_ptr()  # not a fresh (B, V) mapping a token
    with torch.no_grad():
        assert torch.allclose(kept, layer(first_x), rtol=0, atol=1e-6 * float(kept.abs().max()))
        assert torch.allclose(second, layer(second_x), rtol=0, atol=1e-6 * float(second.abs().max()))
    other = blocked(torch.randn(20, 1, layer.in_features))  # another row count: a buffer of its shape
    assert other.shape == (20, 1, layer.out_features)


@pytest.mark.unit
def test_it_is_taken_only_where_it_pays_and_runs():
    if not packed_head_module._mkl_available():
        assert blocked_head(head(), MIN_ROWS) is None
        return
    assert blocked_head(head(), MIN_ROWS) is not None and blocked_head(head(), MAX_ROWS) is not None
    assert blocked_head(head(), MIN_ROWS - 1) is None  # slower with few rows
    assert blocked_head(head(), MAX_ROWS + 1) is None  # no faster with many
    assert blocked_head(head(vocab=4095), 32) is None  # under BLOCKED_FROM elements
    assert blocked_head(head(bias=True), 32) is None
    assert blocked_head(head().to(torch.bfloat16), 32) is None

    class Adapter(nn.Linear):  # a layer with a forward of its own (LoRA, quantized): not ours to replace
        def forward(self, x):
            return super().forward(x) + 1

    assert blocked_head(head(cls=Adapter), 32) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert blocked_head(head(), 32) is None
    partitioned = head()
    partitioned.weight.ds_id = 0  # a DeepSpeed ZeRO-3 partition: gathered inside the module's own forward
    assert blocked_head(partitioned, 32) is None
    if onednn_available():  # --cpu-linear onednn's layer on a product this large: oneDNN's own
        assert blocked_head(head(cls=OneDnnLinear), 32) is None
    with pytest.MonkeyPatch.context() as patch:  # a torch built without MKL (aarch64): the head's own product
        patch.setattr(torch.backends.mkl, "is_available", lambda: False)
        assert blocked_head(head(), 32) is None


def _engine_runs(tiny_model_dir, monkeypatch, configs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(blocked_head_module, "BLOCKED_FROM", 1)  # the tiny model's output layer qualifies
    monkeypatch.setattr(blocked_head_module, "BLOCK", 96)  # its 320 entries in four blocks, the last short
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hi")["input_ids"]]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, return_logprobs=True)
    calls = []
    monkeypatch.setattr(BlockedHead, "__call__", lambda self, x, _call=BlockedHead.__call__: calls.append(1)
                        or _call(self, x))
    runs, counts, models = {}, {}, {}
    for name, config in configs.items():
        models[name] = model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        engine = HFEngine(model, tokenizer, config)
        for _ in range(2):  # the first call checks the lean variant against the forward
            torch.manual_seed(3)
            before = len(calls)
            runs[name] = engine.generate(prompts, n=MIN_ROWS // 2, params=params)  # 16 rows
        counts[name] = len(calls) - before
    return runs, counts, models, params


@pytest.mark.run
@needs_mkl
def test_the_engine_samples_the_same_tokens_with_the_blocked_head(tiny_model_dir, monkeypatch):
    runs, counts, models, params = _engine_runs(tiny_model_dir, monkeypatch, {
        "blocked": HFEngineConfig(decoder="lean"),  # the default: blocks where they pay
        "plain": HFEngineConfig(decoder="lean", block_head=False),
        "direct": HFEngineConfig(decoder="direct")})
    assert verdict(models["blocked"], "lean_decode/padded/grouped/blocked_head") is True
    assert counts["blocked"] == params.max_new_tokens - 1  # every decode step of the second call
    assert counts["plain"] == counts["direct"] == 0
    assert verdict(models["plain"], "lean_decode/padded/grouped/blocked_head") is None
    assert [g.token_ids for g in runs["blocked"]] == [g.token_ids for g in runs["plain"]] \
        == [g.token_ids for g in runs["direct"]]
    for blocked, plain in zip(runs["blocked"], runs["plain"]):
        assert torch.allclose(torch.tensor(blocked.logprobs), torch.tensor(plain.logprobs), atol=1e-6, rtol=0)


@pytest.mark.run
@needs_mkl
def test_a_blocked_head_that_differs_is_caught_and_the_forward_decodes(tiny_model_dir, monkeypatch, caplog):
    wrong = BlockedHead.__call__
    monkeypatch.setattr(BlockedHead, "__call__", lambda self, x: wrong(self, x) * 1.01)
    with caplog.at_level(logging.WARNING):
        runs, counts, models, _ = _engine_runs(tiny_model_dir, monkeypatch, {
            "blocked": HFEngineConfig(decoder="lean"), "direct": HFEngineConfig(decoder="direct")})
    assert verdict(models["blocked"], "lean_decode/padded/grouped/blocked_head") is False
    assert counts["blocked"] == 0  # the second call decodes through the forward
    assert [g.token_ids for g in runs["blocked"]] == [g.token_ids for g in runs["direct"]]
    assert "blocked_head" in caplog.text
