"""Which models the hand-written forwards reproduce, and the transformers internals they use.

The lean decode step (`rlhf.fastpaths.lean_decode`) and the per-segment shared forward
(`rlhf.fastpaths.segment_attention`) run a model's own modules one by one, in the order its
forward does: embed -> per layer (norm, q/k/v projections, rotary, attention, o_proj, norm, mlp)
-> norm -> lm_head. They reach past the public API of transformers in a few places, all listed
here and all checked by `llama_like` before a fast path is taken (a model or a transformers
version without one of them runs the plain forward instead; nothing raises):

* ``apply_rotary_pos_emb(q, k, cos, sin)`` of the attention class's own module (`rotary_function`);
* ``model.model.rotary_emb(hidden, position_ids) -> (cos, sin)``, ``embed_tokens``, ``norm``, ``layers``;
* per attention: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``head_dim``, ``scaling``, no
  ``sliding_window``; per layer: ``input_layernorm``, ``post_attention_layernorm``, ``mlp``;
* ``DynamicCache(config=...)`` holding per layer ``.keys`` / ``.values`` (U, K, P, D) after a
  prefill (`cache_tensors`, lean decode only).

tests/fastpaths/test_transformers_contract.py checks each of these against the installed
transformers for Llama, Qwen2 and Mistral, with the forwards they must reproduce.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from rlhf.core.modeling import base_model

LLAMA_LIKE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")
MODEL_PARTS = ("embed_tokens", "rotary_emb", "norm", "layers")


def rotary_function(attention: Any) -> Callable[..., Any] | None:
    """``apply_rotary_pos_emb`` of the module that defines ``attention``'s class, or None."""
    module = sys.modules.get(type(attention).__module__)
    function = getattr(module, "apply_rotary_pos_emb", None)
    return function if callable(function) else None


def cache_tensors(cache: Any) -> tuple[list[Any], list[Any]] | None:
    """Per layer the keys and values a ``DynamicCache`` holds after a prefill, or None when this
    transformers keeps them otherwise."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    keys = [getattr(layer, "keys", None) for layer in layers]
    values = [getattr(layer, "values", None) for layer in layers]
    if not layers or any(k is None for k in keys) or any(v is None for v in values):
        return None
    return keys, values


def partitioned(module: Any) -> bool:
    """Whether any parameter of ``module`` is marked ``ds_id`` (DeepSpeed ZeRO-3 partitions it). Walks
    the module tree itself: ``parameters()`` costs several times more, and this runs per forward."""
    stack = [module]
    while stack:
        current = stack.pop()
        if any(hasattr(parameter, "ds_id") for parameter in current._parameters.values()):
            return True
        stack.extend(child for child in current._modules.values() if child is not None)
    return False


def llama_like(model: Any) -> bool:
    """Whether ``model`` runs as embed -> layers -> norm -> lm_head with the parts listed in the module
    docstring, so that its own modules called in that order give its forward: a `LLAMA_LIKE` class
    with sdpa attention and no sliding window, every layer with those parts, its rotary function
    found, its weights not partitioned by DeepSpeed ZeRO-3."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if type(base).__name__ not in LLAMA_LIKE or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if partitioned(base):
        return False  # DeepSpeed ZeRO-3 partitions: the model's forward gathers them
    inner = getattr(base, "model", None)
    if inner is None or not all(hasattr(inner, name) for name in MODEL_PARTS) or not hasattr(base, "lm_head"):
        return False
    for layer in inner.layers:
        attention = getattr(layer, "self_attn", None)
        if attention is None or getattr(attention, "sliding_window", None) is not None:
            return False
        if not all(hasattr(attention, name) for name in ATTENTION_PARTS) or rotary_function(attention) is None:
            return False
        if not all(hasattr(layer, name) for name in LAYER_PARTS):
            return False
    return getattr(config, "sliding_window", None) is None or type(base).__name__ == "Qwen2ForCausalLM"
