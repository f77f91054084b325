"""Small facts about transformers models that the runtime and plugins both need. No torch here.

* `base_model`: the transformers model inside a PEFT wrapper (or the model itself). PEFT's
  forward passes keyword arguments through, but its signature hides the inner model's.
* `accepts_logits_to_keep`: whether a model class's forward takes ``logits_to_keep`` (project
  only the last positions to the vocabulary), cached per class.
* `llama_like`: whether a model is built as Llama is, so that code running its modules one by one
  (the lean decode step, the per-segment shared forward) reproduces its forward.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any


def base_model(model: Any) -> Any:
    """The model a PEFT wrapper holds, or ``model`` when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@lru_cache(maxsize=None)
def accepts_logits_to_keep(forward_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(forward_cls.forward).parameters


LLAMA_LIKE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def llama_like(model: Any) -> bool:
    """Whether ``model`` runs as embed -> layers (norm, q/k/v projections, rotary, attention, o_proj,
    norm, mlp) -> norm -> lm_head, so that its own modules called in that order give its forward:
    a `LLAMA_LIKE` class with sdpa attention and no sliding window, every layer with those modules,
    its weights not partitioned by DeepSpeed ZeRO-3."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if type(base).__name__ not in LLAMA_LIKE or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if any(hasattr(parameter, "ds_id") for parameter in base.parameters()):
        return False  # DeepSpeed ZeRO-3 partitions: the model's forward gathers them
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm")):
        return False
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if attention is None or getattr(attention, "sliding_window", None) is not None:
            return False
        if not all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return False
        if not all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return False
    return getattr(config, "sliding_window", None) is None or type(base).__name__ == "Qwen2ForCausalLM"
