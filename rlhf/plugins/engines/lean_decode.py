"""A lean decode step for Llama-architecture models: the same modules, without the model's per-call machinery.

One decode step of a small model spends most of its time outside the arithmetic: the
transformers forward builds a mask, re-derives positions, grows a ``DynamicCache`` by
concatenation and wraps every output. `LeanDecoder` runs a step as the model's own modules and
functions would, in the same order, with the same attention function (transformers'
``sdpa_attention_forward``), but over a key/value cache allocated once for the whole generation:

    h = embed(token); cos, sin = rotary(h, position)
    per layer: x = norm1(h); q, k, v = proj(x); rotate q, k; cache k, v at the position;
               h = h + o_proj(sdpa(q, cache_k[:S], cache_v[:S], valid keys)); h = h + mlp(norm2(h))
    logits = lm_head(norm(h))

so the logits equal the model's forward (tested bit for bit on a tiny Llama, and to float
rounding on Qwen2); LoRA layers run as they would (the projections are the modules, wrapped or
not). The prefill is the model's own forward; its cache, already expanded to one row per
sample, is copied in. Supported: ``LlamaForCausalLM``, and ``Qwen2ForCausalLM`` / ``MistralForCausalLM``
without sliding-window attention, with sdpa attention; anything else decodes through the model's
forward. On a 2-layer 64-wide model one step takes about 0.5 ms instead of 0.65 ms
(benchmarks/README.md).

Shape legend: ``B`` rows, ``S`` cached positions, ``C`` capacity (prompt + new tokens),
``H``/``K`` query/key-value heads, ``D`` head size, ``V`` vocabulary.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from rlhf.core.modeling import base_model

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def lean_decoder_supported(model: Any) -> bool:
    """Whether `LeanDecoder` reproduces ``model``'s forward: a supported class with sdpa attention
    and no sliding window, its layers built as Llama's, its weights not partitioned by ZeRO-3."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if type(base).__name__ not in SUPPORTED or getattr(config, "_attn_implementation", None) != "sdpa":
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


class LeanDecoder:
    """Decode steps of ``model`` after a prefill whose ``DynamicCache`` it takes over."""

    def __init__(self, model: Any, cache: Any, key_mask: torch.Tensor, capacity: int):
        """``cache``: the prefill's ``DynamicCache`` (B rows); ``key_mask`` (B, P): 1 on the
        prompt's real tokens; ``capacity``: positions to hold (P + new tokens)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        base = base_model(model)
        self.inner, self.head = base.model, base.lm_head
        self.attend = sdpa_attention_forward
        self.rotate = [sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb for layer in self.inner.layers]
        rows, length = key_mask.shape  # (B, P)
        self.keys, self.values = [], []
        for index in range(len(self.inner.layers)):
            layer_cache = cache.layers[index]
            keys, values = layer_cache.keys, layer_cache.values  # (B, K, P, D)
            store_k = keys.new_zeros((rows, keys.shape[1], capacity, keys.shape[3]))  # (B, K, C, D)
            store_v = torch.zeros_like(store_k)  # (B, K, C, D)
            store_k[:, :, :length], store_v[:, :, :length] = keys, values
            self.keys.append(store_k)
            self.values.append(store_v)
        self.valid = torch.ones((rows, capacity), dtype=torch.bool, device=key_mask.device)  # (B, C)
        self.valid[:, :length] = key_mask.bool()
        self.padded = not bool(key_mask.bool().all())  # no padding: no mask, as the model's forward does
        self.length = length

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after feeding ``tokens`` (B,) at ``positions`` (B, 1) (their positions in their
        own rows); the token is cached at the next free slot."""
        slot, length = self.length, self.length + 1
        hidden = self.inner.embed_tokens(tokens[:, None])  # (B, 1, hidden)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        mask = self.valid[:, None, None, :length] if self.padded else None  # (B, 1, 1, S) or None
        rows = tokens.shape[0]
        for index, layer in enumerate(self.inner.layers):
            attention = layer.self_attn
            residual = hidden
            x = layer.input_layernorm(hidden)  # (B, 1, hidden)
            shape = (rows, 1, -1, attention.head_dim)
            query = attention.q_proj(x).view(shape).transpose(1, 2)  # (B, H, 1, D)
            key = attention.k_proj(x).view(shape).transpose(1, 2)  # (B, K, 1, D)
            value = attention.v_proj(x).view(shape).transpose(1, 2)  # (B, K, 1, D)
            query, key = self.rotate[index](query, key, cos, sin)
            self.keys[index][:, :, slot:length] = key
            self.values[index][:, :, slot:length] = value
            out, _ = self.attend(attention, query, self.keys[index][:, :, :length], self.values[index][:, :, :length],
                                 mask, dropout=0.0, scaling=attention.scaling)  # (B, 1, H, D)
            hidden = residual + attention.o_proj(out.reshape(rows, 1, -1).contiguous())
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.length = length
        return self.head(self.inner.norm(hidden))[:, -1]  # (B, V)
