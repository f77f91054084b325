"""The engine's lean decode step (rlhf/fastpaths/lean_decode.py) gives the model's forward:

* sampled tokens and log-probs equal the ``direct`` decoder's under the same seed (left-padded
  prompts of different lengths, n samples sharing a prefill and its cache, rows ending early),
  and its logits equal the forward's at every step (a prompt's cache kept once for its samples,
  or copied per row), on a Llama and on a Qwen2 (biased projections, grouped key-value heads);
* ``auto`` uses it where it is supported, never for other models or with sharded weights;
  ``decoder=lean`` on an unsupported model (or a transformers without the internals it reads)
  warns and decodes through the forward;
* each variant of the step (prompts padded or not, their caches shared or copied) is checked
  against the forward on its own first use on a model, over several steps while the cache grows:
  a variant that differs is caught there, with a warning, and the forward runs from then on.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.core.modeling import cache_argument
from rlhf.core.protocols.rollout import SamplingParams
from rlhf.plugins.engines.hf import HFEngine, HFEngineConfig
from rlhf.fastpaths import llama_like as llama_like_module
from rlhf.fastpaths.lean_decode import LeanDecoder, lean_decoder_supported
from rlhf.fastpaths.verdicts import verdict

PADDED = "lean_decode/padded/grouped"  # prompts() differ in length; n samples read their prompt's cache


def build(kind: str, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    if kind == "llama":
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa", eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config).eval(), tokenizer


@pytest.fixture(params=["llama", "qwen2"])
def model_and_tokenizer(request, tiny_model_dir):
    return build(request.param, tiny_model_dir)


def prompts(tokenizer):
    return [tokenizer("What is 12 + 7?")["input_ids"], tokenizer("hi")["input_ids"],
            tokenizer("Say many a's please")["input_ids"]]


@pytest.mark.unit
def test_the_lean_step_is_used_where_supported(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    assert lean_decoder_supported(model)
    assert HFEngine(model, tokenizer).uses_lean_step()
    assert not HFEngine(model, tokenizer, HFEngineConfig(decoder="direct")).uses_lean_step()
    assert not HFEngine(model, tokenizer, HFEngineConfig(synced_gpus=True)).uses_lean_step()


@pytest.mark.run
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_lean_samples_what_the_direct_decoder_samples(model_and_tokenizer, temperature):
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=16, temperature=temperature, return_logprobs=True)
    runs = {}
    for decoder in ("lean", "direct"):
        engine = HFEngine(model, tokenizer, HFEngineConfig(decoder=decoder))
        for _ in range(2):  # the second call runs on the lean step alone (the first one checks it)
            torch.manual_seed(4)
            runs[decoder] = engine.generate(prompts(tokenizer), n=3, params=params)
        if decoder == "lean":
            assert verdict(model, PADDED) is True
    lean, direct = runs["lean"], runs["direct"]
    assert [g.token_ids for g in lean] == [g.token_ids for g in direct]
    if temperature > 0:
        assert len({tuple(g.token_ids) for g in lean}) > 3  # sampled, not copies
    for a, b in zip(lean, direct):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)


def lean_steps(model, tokenizer, source, during_step=None):
    """Prefill prompts() (a cache row per prompt), then 8 decode steps of random tokens through a
    `LeanDecoder` and through the model's forward over a cache with a row per sample; yields
    (decoder, step, lean logits (B, V), the forward's logits (B, V)). ``during_step``: a one-item
    list set True while the lean step runs."""
    from transformers import DynamicCache

    rows = prompts(tokenizer)
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])  # (U, P) left-padded
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # (U, P)
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # (U, P)
    source = torch.tensor(source) if source is not None else None
    expand = source if source is not None else torch.arange(len(rows))  # (B,)
    during_step = during_step if during_step is not None else [False]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        cached = {cache_argument(type(model)): cache}  # `cache` where the forward takes it, else past_key_values
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cached)
        lean = LeanDecoder(model, cache, mask, 8, source)
        cache.batch_select_indices(expand)  # the forward's cache: a row per sample
        mask, positions = mask[expand], positions[expand]  # (B, P)
        for t in range(8):
            tokens = torch.randint(5, 200, (len(expand),), generator=generator)  # (B,)
            step_positions = positions[:, -1:] + 1 + t  # (B, 1)
            full_mask = torch.cat([mask, torch.ones((len(expand), t + 1), dtype=mask.dtype)], dim=1)
            expected = model(input_ids=tokens[:, None], attention_mask=full_mask, position_ids=step_positions,
                             use_cache=True, **cached).logits[:, -1]  # (B, V)
            during_step[0] = True
            got = lean.step(tokens, step_positions)  # (B, V)
            during_step[0] = False
            yield lean, t, got, expected


@pytest.mark.unit
@pytest.mark.parametrize("source", [None, [0, 0, 1, 1, 2, 2], [2, 0, 1, 0]],
                         ids=["a-row-per-prompt", "a-prompts-samples-together", "any-order"])
def test_every_lean_step_gives_the_forwards_logits(model_and_tokenizer, source):
    """The prompt's cache kept once for its samples (``source`` in groups) or copied per row (any
    other order) gives the logits of the model's forward over a cache with a row per sample."""
    model, tokenizer = model_and_tokenizer
    steps = 0
    for lean, t, got, expected in lean_steps(model, tokenizer, source):
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), t
        steps += 1
    assert steps == 8
    if source is not None and len(source) == 6:
        assert lean.prompt_keys[0].shape[0] == 3  # one cache row per prompt, not per sample


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_half_precision_decode_on_a_cpu_keeps_its_own_tokens_in_float32(model_and_tokenizer, dtype, monkeypatch):
    """bf16/fp16 on a CPU: the rows' own keys and values are float32 (the prompts' stay in the
    model's dtype), so the products over a length that grows every step are float32 ones (oneDNN
    compiles and keeps a kernel for every half-precision shape it meets); the logits still equal
    the forward's within half-precision rounding at every step. A float32 model is unchanged."""
    model, tokenizer = model_and_tokenizer
    model = model.to(dtype)
    source = [0, 0, 1, 1, 2, 2]
    recording, products = [False], []  # (dtype, shape) of the right operand of every product a lean step runs
    matmul = torch.matmul

    def recorded(a, b):
        if recording[0]:
            products.append((b.dtype, tuple(b.shape)))
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", recorded)
    for lean, t, got, expected in lean_steps(model, tokenizer, source, during_step=recording):
        assert {k.dtype for k in lean.keys + lean.values} == {torch.float32}
        assert {k.dtype for k in lean.prompt_keys + lean.prompt_values} == {dtype}
        assert got.dtype == dtype
        if dtype == torch.float32:
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), t
        else:  # relative to the logits' scale, as the engine's own check measures
            scale = max(1.0, float(expected.float().abs().max()))
            assert float((got.float() - expected.float()).abs().max()) / scale < 2e-2, t
    assert len(products) == 4 * len(model.model.layers) * 8  # scores and weighted values, prompt and own
    own = [(kind, shape) for kind, shape in products if shape[0] == len(source)]  # (B, K, D, S), (B, K, S, D)
    prompt = [(kind, shape) for kind, shape in products if shape[0] == len(prompts(tokenizer))]  # (U, K, D, P), ...
    assert len(own) + len(prompt) == len(products)
    assert {kind for kind, _ in own} == {torch.float32} and {kind for kind, _ in prompt} == {dtype}
    assert len({shape for _, shape in own}) == 2 * 8  # a length more each step
    assert len({shape for _, shape in prompt}) == 2  # one length for the whole decode


@pytest.mark.unit
def test_only_half_precision_caches_on_a_cpu_hold_their_own_tokens_in_float32():
    """Elsewhere (a GPU: no per-shape kernels to keep, and half precision is the fast product) the
    own caches keep the model's dtype."""
    from rlhf.fastpaths.lean_decode import own_cache_dtype

    for dtype in (torch.bfloat16, torch.float16):
        assert own_cache_dtype(torch.empty(1, dtype=dtype)) == torch.float32
        assert own_cache_dtype(torch.empty(1, dtype=dtype, device="meta")) == dtype
    for device in ("cpu", "meta"):
        assert own_cache_dtype(torch.empty(1, dtype=torch.float32, device=device)) == torch.float32
        assert own_cache_dtype(torch.empty(1, dtype=torch.float64, device=device)) == torch.float64


@pytest.mark.unit
def test_unsupported_models_decode_through_the_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert not lean_decoder_supported(eager)
    assert not HFEngine(eager, tokenizer).uses_lean_step()
    from transformers import MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                sliding_window=16, attn_implementation="sdpa"))
    assert not lean_decoder_supported(windowed)
    llama, _ = build("llama", tiny_model_dir)
    assert lean_decoder_supported(llama)
    renamed, _ = build("llama", tiny_model_dir)
    attention = renamed.model.layers[0].self_attn
    attention.qkv = attention.q_proj  # an architecture that names its projections otherwise
    del attention.q_proj
    assert not lean_decoder_supported(renamed)
    next(llama.parameters()).ds_id = 0  # as DeepSpeed ZeRO-3 marks the parameters it partitions
    assert not lean_decoder_supported(llama)


@pytest.mark.run
def test_decoder_lean_on_an_unsupported_model_warns_and_decodes_through_the_forward(tiny_model_dir, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    with caplog.at_level("WARNING"):
        engine = HFEngine(eager, tokenizer, HFEngineConfig(decoder="lean"))
    assert "decoder 'lean' needs a Llama-architecture model" in caplog.text and not engine.uses_lean_step()
    expected = HFEngine(eager, tokenizer, HFEngineConfig(decoder="direct")).generate(prompts(tokenizer), n=1,
                                                                                    params=params)
    assert [g.token_ids for g in engine.generate(prompts(tokenizer), n=1, params=params)] == \
        [g.token_ids for g in expected]


@pytest.mark.run
def test_every_internal_the_lean_step_reads_is_checked(tiny_model_dir, monkeypatch, caplog):
    """A transformers without one of the internals: the model is not Llama-like (rotary function),
    or the engine warns and decodes through the forward (the cache's per-layer tensors)."""
    model, tokenizer = build("llama", tiny_model_dir)
    monkeypatch.setattr(llama_like_module, "rotary_function", lambda attention: None)
    assert not lean_decoder_supported(model)
    monkeypatch.undo()
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    expected = HFEngine(model, tokenizer, HFEngineConfig(decoder="direct")).generate(prompts(tokenizer), n=2,
                                                                                    params=params)
    monkeypatch.setattr("rlhf.fastpaths.lean_decode.cache_tensors", lambda cache: None)
    engine = HFEngine(model, tokenizer)
    with caplog.at_level("WARNING"):
        got = engine.generate(prompts(tokenizer), n=2, params=params)
    assert "the lean decode step cannot run here" in caplog.text
    assert [g.token_ids for g in got] == [g.token_ids for g in expected] and verdict(model, PADDED) is None


def _decode_differs(monkeypatch, when):
    """The lean step's logits off by 1e-2 where ``when(decoder)`` holds."""
    real_step = LeanDecoder.step

    def step(self, tokens, positions):
        logits = real_step(self, tokens, positions)
        return logits + 1e-2 if when(self) else logits

    monkeypatch.setattr(LeanDecoder, "step", step)


@pytest.mark.run
def test_a_lean_step_that_differs_is_caught_and_the_forward_runs(tiny_model_dir, monkeypatch, caplog):
    model, tokenizer = build("llama", tiny_model_dir)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, return_logprobs=True)
    expected = HFEngine(model, tokenizer, HFEngineConfig(decoder="direct")).generate(prompts(tokenizer), n=2,
                                                                                    params=params)
    _decode_differs(monkeypatch, lambda lean: True)
    engine = HFEngine(model, tokenizer)
    with caplog.at_level("WARNING"):
        got = engine.generate(prompts(tokenizer), n=2, params=params)
        again = engine.generate(prompts(tokenizer), n=2, params=params)
    assert verdict(model, PADDED) is False
    assert f"the fast path {PADDED} differs from the plain path" in caplog.text
    assert caplog.text.count("differs from the plain path") == 1  # settled once; the forward from then on
    for run in (got, again):
        assert [g.token_ids for g in run] == [g.token_ids for g in expected]
        assert [g.logprobs for g in run] == [g.logprobs for g in expected]


@pytest.mark.run
def test_a_lean_step_that_differs_only_once_the_cache_has_grown_is_caught(tiny_model_dir, monkeypatch):
    model, tokenizer = build("llama", tiny_model_dir)
    _decode_differs(monkeypatch, lambda lean: lean.length >= 3)  # right for two steps, then wrong
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine = HFEngine(model, tokenizer)
    expected = HFEngine(model, tokenizer, HFEngineConfig(decoder="direct")).generate(prompts(tokenizer), n=2,
                                                                                    params=params)
    got = engine.generate(prompts(tokenizer), n=2, params=params)
    assert verdict(model, PADDED) is False
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]


@pytest.mark.run
def test_each_variant_of_the_lean_step_is_checked_on_its_own_first_use(tiny_model_dir, monkeypatch, caplog):
    """Agreement on padded prompts says nothing of unpadded ones (no key mask), nor of a prompt's
    cache copied per row: each is checked when it first runs."""
    model, tokenizer = build("llama", tiny_model_dir)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    engine = HFEngine(model, tokenizer)
    engine.generate(prompts(tokenizer), n=2, params=params)
    assert verdict(model, PADDED) is True and verdict(model, "lean_decode/unpadded/grouped") is None
    _decode_differs(monkeypatch, lambda lean: not lean.padded)  # a bug in the unpadded variant only
    same_length = [[40, 41, 42, 43], [50, 51, 52, 53]]  # no padding
    expected = HFEngine(model, tokenizer, HFEngineConfig(decoder="direct")).generate(same_length, n=2, params=params)
    with caplog.at_level("WARNING"):
        got = engine.generate(same_length, n=2, params=params)
    assert verdict(model, "lean_decode/unpadded/grouped") is False and verdict(model, PADDED) is True
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    assert "lean_decode/unpadded/grouped differs" in caplog.text


@pytest.mark.run
def test_lean_runs_the_lora_layers_of_a_peft_policy(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = build("llama", tiny_model_dir)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # the adapter changes the logits
    params = SamplingParams(max_new_tokens=10, temperature=0.0, return_logprobs=True)
    assert HFEngine(wrapped, tokenizer).uses_lean_step()
    lean = HFEngine(wrapped, tokenizer, HFEngineConfig(decoder="lean")).generate(prompts(tokenizer), n=1, params=params)
    direct = HFEngine(wrapped, tokenizer, HFEngineConfig(decoder="direct")).generate(prompts(tokenizer), n=1,
                                                                                    params=params)
    with wrapped.disable_adapter():
        plain = HFEngine(wrapped, tokenizer, HFEngineConfig(decoder="direct")).generate(prompts(tokenizer), n=1,
                                                                                       params=params)
    assert [g.token_ids for g in lean] == [g.token_ids for g in direct]
    assert [g.logprobs for g in lean] != [g.logprobs for g in plain]  # the adapter mattered
    for a, b in zip(lean, direct):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)


@pytest.mark.unit
def test_the_lean_check_measures_the_difference_relative_to_the_logits_scale():
    """bf16/fp16 logits of a large scale differ by more in absolute terms: the check divides by the
    scale (at least 1), so a difference of 0.01 on logits of size 100 is 1e-4."""
    from rlhf.plugins.engines.hf import _relative_difference

    logits = torch.tensor([[100.0, -50.0, 3.0]])
    assert _relative_difference(logits + torch.tensor([[0.01, 0.0, 0.0]]), logits) == pytest.approx(1e-4, rel=1e-3)
    small = torch.tensor([[0.5, -0.2]])
    assert _relative_difference(small + 0.001, small) == pytest.approx(1e-3, rel=1e-3)  # scale below 1: absolute
