"""The decode's output layer with its weight laid out once (rlhf/fastpaths/packed_head.py):

* its logits equal the layer's own forward to float rounding, through MKL
  (``nn.Linear``) and through oneDNN (`OneDnnLinear`), with and without a bias, for any number of
  rows, and for an output layer that vocab chunks took over;
* it is taken only where it pays and can run (a large float32 weight on a CPU, enough steps, the
  layer's own forward one of the two), and a weight loaded in place is laid out again;
* the engine's lean step with it samples what the direct decoder and the lean step without it
  sample, checked against the forward under a variant name of its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhf.core.protocols.rollout import SamplingParams
from rlhf.fastpaths import packed_head as packed_head_module
from rlhf.fastpaths.cpu_linear import OneDnnLinear, onednn_available, use_onednn_linears
from rlhf.fastpaths.packed_head import PACK_STEPS, PackedHead, packed_head
from rlhf.fastpaths.verdicts import verdict
from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig

needs_mkl = pytest.mark.skipif(not packed_head_module._mkl_available(), reason="this torch has no MKL")
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


def assert_same_logits(got, expected):
    """Equal to float rounding: 1e-5 of the largest logit (measured: bit for bit through MKL at
    most shapes, up to 6e-7 through oneDNN at a row count other than the layout's)."""
    assert float((got - expected).abs().max()) <= 1e-5 * max(1.0, float(expected.abs().max()))


def head(vocab=4096, hidden=1024, bias=False, cls=nn.Linear):
    torch.manual_seed(0)
    layer = nn.Linear(hidden, vocab, bias=bias)  # 4M weight elements: at PACK_FROM
    layer.__class__ = cls
    return layer


@pytest.mark.unit
@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cls, library", [(nn.Linear, "mkl"), pytest.param(OneDnnLinear, "onednn", marks=needs_onednn)])
def test_the_packed_product_equals_the_layer_s_own_forward(bias, cls, library):
    layer = head(bias=bias, cls=cls)
    packed = packed_head(layer, rows=8, steps=PACK_STEPS)
    assert isinstance(packed, PackedHead) and packed.library == library
    layer.requires_grad_(True)  # a policy's output layer: the decode builds no graph on it
    for rows in (8, 3, 1):  # rows that finished still decode; any count runs on the same layout
        x = torch.randn(rows, 1, layer.in_features)  # (B, 1, H)
        with torch.no_grad():
            assert_same_logits(packed(x), layer(x))
        assert not packed(x).requires_grad


@pytest.mark.unit
@needs_mkl
def test_a_weight_loaded_in_place_or_replaced_is_laid_out_again():
    layer = head()
    packed = packed_head(layer, rows=4, steps=PACK_STEPS)
    x = torch.randn(4, 1, layer.in_features)
    before = packed(x)
    with torch.no_grad():
        layer.load_state_dict({"weight": layer.weight * 2})  # copied in: the version counter moves
    with torch.no_grad():
        assert_same_logits(packed(x), layer(x))
    assert_same_logits(packed(x), 2 * before)
    layer.weight = nn.Parameter(torch.randn_like(layer.weight))  # a new tensor
    with torch.no_grad():
        assert_same_logits(packed(x), layer(x))


@pytest.mark.run
@needs_mkl
def test_the_copy_goes_with_the_decode_without_the_garbage_collector(tiny_model_dir, monkeypatch):
    """The laid-out copy is as large as the output layer: freed when the decode ends (reference
    counting), not left for the cyclic collector to find while the update runs."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(packed_head_module, "PACK_FROM", 1)
    made = []
    monkeypatch.setattr(PackedHead, "__init__", lambda self, *a, _init=PackedHead.__init__: made.append(
        weakref.ref(self)) or _init(self, *a))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer,
                      HFEngineConfig(decoder="lean", pack_head=True))
    params = SamplingParams(max_new_tokens=PACK_STEPS, temperature=0.9)
    engine.generate([tokenizer("hi")["input_ids"]], n=2, params=params)  # checks the variant beside the forward
    gc.disable()
    try:
        engine.generate([tokenizer("hi")["input_ids"]], n=2, params=params)
        assert len(made) == 2 and all(ref() is None for ref in made)
    finally:
        gc.enable()


@pytest.mark.unit
def test_it_is_taken_only_where_it_pays_and_runs():
    if not packed_head_module._mkl_available():
        assert packed_head(head(), rows=8, steps=PACK_STEPS) is None
        return
    assert packed_head(head(), rows=8, steps=PACK_STEPS) is not None
    assert packed_head(head(), rows=8, steps=PACK_STEPS - 1) is None  # too few steps to pay back the layout
    assert packed_head(head(vocab=4095), rows=8, steps=512) is None  # under PACK_FROM elements
    assert packed_head(head().to(torch.bfloat16), rows=8, steps=512) is None

    class Adapter(nn.Linear):  # a layer with a forward of its own (LoRA, quantized): not ours to replace
        def forward(self, x):
            return super().forward(x) + 1

    assert packed_head(head(cls=Adapter), rows=8, steps=512) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed_head(head(), rows=8, steps=512) is None
    partitioned = head()
    partitioned.weight.ds_id = 0  # a DeepSpeed ZeRO-3 partition: gathered inside the module's own forward
    assert packed_head(partitioned, rows=8, steps=512) is None
    with pytest.MonkeyPatch.context() as patch:  # a torch built without MKL (aarch64): the head's own product
        patch.setattr(torch.backends.mkl, "is_available", lambda: False)
        assert packed_head(head(), rows=8, steps=512) is None


@pytest.mark.unit
@needs_mkl
def test_a_vocab_chunked_output_layer_is_packed_with_its_own_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.fastpaths.vocab_chunks import use_vocab_chunks

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert use_vocab_chunks(model)
    layer = model.get_output_embeddings()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_head_module, "PACK_FROM", 1)
        packed = packed_head(layer, rows=2, steps=PACK_STEPS)
    assert packed is not None and packed.library == "mkl"
    x = torch.randn(2, 1, layer.in_features)
    with torch.no_grad():
        assert_same_logits(packed(x), layer(x))


@pytest.mark.run
@needs_mkl
@pytest.mark.parametrize("linears", ["torch", pytest.param("onednn", marks=needs_onednn)])
def test_the_engine_samples_the_same_tokens_with_the_packed_head(tiny_model_dir, monkeypatch, linears):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(packed_head_module, "PACK_FROM", 1)  # the tiny model's output layer qualifies
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hi")["input_ids"]]
    params = SamplingParams(max_new_tokens=PACK_STEPS, temperature=0.9, return_logprobs=True)
    calls = []
    monkeypatch.setattr(PackedHead, "__call__", lambda self, x, _call=PackedHead.__call__: calls.append(1)
                        or _call(self, x))
    runs = {}
    for name, config in (("packed", HFEngineConfig(decoder="lean", pack_head=True)),
                         ("unpacked", HFEngineConfig(decoder="lean")),  # the default: not packed
                         ("direct", HFEngineConfig(decoder="direct"))):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        use_onednn_linears(model, linears)
        engine = HFEngine(model, tokenizer, config)
        for _ in range(2):  # the first call checks the lean variant against the forward
            torch.manual_seed(3)
            before = len(calls)
            runs[name] = engine.generate(prompts, n=3, params=params)
        if name == "packed":
            assert verdict(model, "lean_decode/padded/grouped/packed_head") is True
            assert len(calls) - before == PACK_STEPS - 1  # every decode step of the second call, on the packed layer
        else:
            assert len(calls) == before
        if name == "unpacked":
            assert verdict(model, "lean_decode/padded/grouped/packed_head") is None
    assert [g.token_ids for g in runs["packed"]] == [g.token_ids for g in runs["unpacked"]] \
        == [g.token_ids for g in runs["direct"]]
    for packed, unpacked in zip(runs["packed"], runs["unpacked"]):
        assert torch.allclose(torch.tensor(packed.logprobs), torch.tensor(unpacked.logprobs), atol=1e-6, rtol=0)
