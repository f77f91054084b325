"""The transformers behaviour the fast paths rely on, checked against the installed transformers.

Each test states one thing a fast path reads or assumes (rlhf/fastpaths/llama_like.py lists the
internals), on Llama, Qwen2 (biased projections, grouped key-value heads) and Mistral, built from
configs with random weights. A transformers release that changes one of these fails here by name,
before any training number moves; the fast paths themselves then fall back (`llama_like` is False,
the lean step warns) rather than raise.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from rlhf.core.modeling import accepts_logits_to_keep, cache_argument
from rlhf.fastpaths.llama_like import (ATTENTION_PARTS, LAYER_PARTS, MODEL_PARTS, cache_tensors, llama_like,
                                       rotary_function)

pytestmark = pytest.mark.unit

ARCHITECTURES = ("llama", "qwen2", "mistral")


def build(kind: str) -> torch.nn.Module:
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM")}[kind]
    extra = {"sliding_window": None} if kind == "mistral" else {}
    config = getattr(transformers, config_cls)(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


@pytest.fixture(params=ARCHITECTURES)
def model(request):
    return build(request.param)


def ids_and_positions(rows: int = 2, length: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (rows, length), generator=generator)  # (B, T)
    return ids, torch.arange(length).repeat(rows, 1)  # (B, T)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def test_the_models_have_every_part_the_hand_written_forwards_call(model):
    inner = model.model
    assert all(hasattr(inner, name) for name in MODEL_PARTS) and hasattr(model, "lm_head")
    for layer in inner.layers:
        assert all(hasattr(layer.self_attn, name) for name in ATTENTION_PARTS)
        assert all(hasattr(layer, name) for name in LAYER_PARTS)
        assert getattr(layer.self_attn, "sliding_window", None) is None
    assert model.config._attn_implementation == "sdpa"
    assert llama_like(model)


def test_the_attention_scaling_is_one_over_the_root_of_the_head_size(model):
    attention = model.model.layers[0].self_attn
    assert attention.head_dim == model.config.hidden_size // model.config.num_attention_heads
    assert attention.scaling == pytest.approx(attention.head_dim ** -0.5)


def test_rotary_embedding_and_apply_rotary_pos_emb_rotate_by_position(model):
    """``rotary_emb(hidden, position_ids) -> (cos, sin)`` (B, T, D) and the attention module's own
    ``apply_rotary_pos_emb(q, k, cos, sin)`` = x·cos + rotate_half(x)·sin, heads broadcast."""
    ids, positions = ids_and_positions()
    hidden = model.model.embed_tokens(ids)  # (B, T, hidden)
    cos, sin = model.model.rotary_emb(hidden, positions)
    head_dim = model.model.layers[0].self_attn.head_dim
    assert cos.shape == sin.shape == (2, 6, head_dim)
    assert torch.allclose(cos[:, 0], torch.ones(2, head_dim)) and torch.allclose(sin[:, 0], torch.zeros(2, head_dim))
    rotate = rotary_function(model.model.layers[0].self_attn)
    assert rotate is not None and list(inspect.signature(rotate).parameters)[:4] == ["q", "k", "cos", "sin"]
    query, key = torch.randn(2, 4, 6, head_dim), torch.randn(2, 2, 6, head_dim)  # (B, H, T, D), (B, K, T, D)
    got_q, got_k = rotate(query, key, cos, sin)
    assert torch.allclose(got_q, query * cos[:, None] + rotate_half(query) * sin[:, None], atol=1e-6)
    assert torch.allclose(got_k, key * cos[:, None] + rotate_half(key) * sin[:, None], atol=1e-6)


def test_a_dynamic_cache_keeps_each_layers_rotated_keys_and_values(model):
    """``DynamicCache(config=...)`` after a prefill holds per layer ``.keys`` / ``.values`` (B, K, T, D):
    the keys after the rotary embedding, as the lean step reads them; ``batch_select_indices``
    picks rows."""
    from transformers import DynamicCache

    ids, positions = ids_and_positions()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=True, **{cache_argument(type(model)): cache})
        tensors = cache_tensors(cache)
        assert tensors is not None
        keys, values = tensors
        assert len(keys) == len(model.model.layers) and keys[0].shape == (2, 2, 6, 8) == values[0].shape
        layer = model.model.layers[0]
        hidden = layer.input_layernorm(model.model.embed_tokens(ids))  # (B, T, hidden)
        cos, sin = model.model.rotary_emb(hidden, positions)
        key = layer.self_attn.k_proj(hidden).view(2, 6, -1, 8).transpose(1, 2)  # (B, K, T, D)
        value = layer.self_attn.v_proj(hidden).view(2, 6, -1, 8).transpose(1, 2)
        assert torch.allclose(keys[0], key * cos[:, None] + rotate_half(key) * sin[:, None], atol=1e-5)
        assert torch.allclose(values[0], value, atol=1e-6)
    selected = keys[0][torch.tensor([1, 1, 0])].clone()
    cache.batch_select_indices(torch.tensor([1, 1, 0]))
    assert torch.equal(cache_tensors(cache)[0][0], selected)


def test_the_cache_is_passed_by_the_name_the_forward_takes_without_a_deprecation_warning(model):
    """The hf engine passes its KV cache as ``cache`` where the forward takes it (transformers 5.2x,
    where ``past_key_values`` warns and goes in 5.40) and as ``past_key_values`` before; either way
    the cache fills, and the next step's logits equal the full forward's."""
    import warnings

    from transformers import DynamicCache

    ids, _ = ids_and_positions(rows=1, length=6)
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            model(input_ids=ids[:, :5], use_cache=True, **{cache_argument(type(model)): cache})
            step = model(input_ids=ids[:, 5:], use_cache=True, **{cache_argument(type(model)): cache}).logits[:, -1]
            full = model(input_ids=ids).logits[:, -1]
    assert cache.get_seq_length() == 6
    assert torch.allclose(step, full, atol=1e-5)


def test_restarting_position_ids_without_a_mask_keep_packed_sequences_apart(model):
    """Packing: one row of several sequences, position ids restarting at 0, no attention mask and no
    cache (with one, transformers reads the row as one sequence), gives each sequence its own logits."""
    ids, _ = ids_and_positions(rows=2, length=5)
    with torch.no_grad():
        separate = model(input_ids=ids).logits  # (2, 5, V)
        packed = model(input_ids=ids.reshape(1, 10), position_ids=torch.arange(5).repeat(1, 2),
                       attention_mask=None, use_cache=False).logits  # (1, 10, V)
    assert torch.allclose(packed[0].view(2, 5, -1), separate, atol=1e-5)


def test_a_4d_boolean_mask_is_used_as_given(model):
    """Prefix sharing: a (G, 1, L, L) boolean mask (True: may attend) reaches sdpa unchanged; two
    remainders after one prefix see the prefix and themselves only."""
    prefix, first, second = torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11])
    row = torch.cat([prefix, first, second])[None]  # (1, 7)
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4]])  # (1, 7) each remainder continues the prefix
    allowed = torch.ones(7, 7).tril().bool()
    allowed[5:, 3:5] = False  # the second remainder does not see the first
    with torch.no_grad():
        shared = model(input_ids=row, position_ids=positions, attention_mask=allowed[None, None]).logits[0]
        alone = model(input_ids=torch.cat([prefix, second])[None]).logits[0]  # (5, V)
    assert torch.allclose(shared[5:], alone[3:], atol=1e-5)


def test_logits_to_keep_takes_a_tensor_of_positions(model):
    """Packing and prefix sharing project only the positions they need: ``logits_to_keep`` given a
    1-D tensor of indices returns the logits at exactly those positions."""
    assert accepts_logits_to_keep(type(model))
    ids, _ = ids_and_positions(rows=1, length=8)
    keep = torch.tensor([1, 4, 6])
    with torch.no_grad():
        every = model(input_ids=ids).logits  # (1, 8, V)
        some = model(input_ids=ids, logits_to_keep=keep).logits  # (1, 3, V)
    assert torch.allclose(some, every[:, keep], atol=1e-6)


@pytest.mark.parametrize("part", [*MODEL_PARTS, "lm_head", "input_layernorm", "q_proj", "scaling"])
def test_a_model_without_one_of_the_parts_is_not_llama_like(part):
    """What `llama_like` promises: any one part missing (a renamed module, another transformers)
    means the plain forward, never an AttributeError inside a fast path."""
    model = build("llama")
    owner = {"lm_head": model, "input_layernorm": model.model.layers[1],
             "q_proj": model.model.layers[1].self_attn, "scaling": model.model.layers[1].self_attn}.get(part, model.model)
    assert llama_like(model)
    delattr(owner, part)
    assert not llama_like(model)


def test_gradient_checkpointing_is_flagged_on_the_model_or_its_layers(model):
    """`segment_forward_supported` reads the flag on the model, its inner model and its layers only."""
    from rlhf.fastpaths.segment_attention import segment_forward_supported

    assert segment_forward_supported(model)
    model.gradient_checkpointing_enable()
    flagged = [module for module in model.modules() if getattr(module, "gradient_checkpointing", False)]
    looked_at = [model, model.model, *model.model.layers]
    assert flagged and all(any(module is seen for seen in looked_at) for module in flagged)
    assert not segment_forward_supported(model)


@pytest.mark.parametrize("where", ["embedding", "last layer", "head"])
def test_a_partitioned_parameter_anywhere_makes_a_model_not_llama_like(where):
    """DeepSpeed ZeRO-3 marks the parameters it partitions with ``ds_id``; one marked parameter
    anywhere in the tree and the model's own forward must run."""
    model = build("llama")
    assert llama_like(model)
    parameter = {"embedding": model.model.embed_tokens.weight, "head": model.lm_head.weight,
                 "last layer": model.model.layers[-1].mlp.down_proj.weight}[where]
    parameter.ds_id = 3
    assert not llama_like(model)
