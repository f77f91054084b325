"""A lean decode step for Llama-architecture models: the same modules, without the model's per-call machinery.

One decode step of a small model spends most of its time outside the arithmetic: the
transformers forward builds a mask, re-derives positions, grows a ``DynamicCache`` by
concatenation and wraps every output. `LeanDecoder` runs a step with the model's own modules
and functions, in the same order, over caches allocated once for the whole generation:

    h = embed(token); cos, sin = rotary(h, position)
    per layer: x = norm1(h); q, k, v = proj(x); rotate q, k; cache k, v at the step;
               h = h + o_proj(attend(q, [prompt k, v; own k, v])); h = h + mlp(norm2(h))
    logits = lm_head(norm(h))          (as blocks of W·hᵀ, or its weight laid out once per decode,
                                        where that pays)

The attention is softmax(q·kᵀ / √D)·v written out over two caches: the prompt's keys and values,
kept once per prompt (a prompt's n samples read them together: n times less memory traffic over
the prompt, which dominates decoding with long prompts and many samples), and each row's own
decoded tokens. The logits equal the model's forward to float rounding (tested on Llama and on
Qwen2 with biases and grouped-query heads); LoRA layers run as they would (the projections are
the modules, wrapped or not). The prefill is the model's own forward. Supported:
``LlamaForCausalLM``, and ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` without sliding-window
attention, with sdpa attention; anything else decodes through the model's forward. Figures:
benchmarks/README.md.

Shape legend: ``B`` rows, ``U`` distinct prompts (n = B / U rows each), ``P`` prompt positions,
``S`` decoded tokens, ``N`` new tokens at most, ``H``/``K`` query/key-value heads (g = H / K),
``D`` head size, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf.core.modeling import base_model
from rlhf.fastpaths.llama_like import cache_tensors, llama_like, rotary_function
from rlhf.fastpaths.blocked_head import blocked_head
from rlhf.fastpaths.packed_head import PackedHead, packed_head


def lean_decoder_supported(model: Any) -> bool:
    """Whether `LeanDecoder` reproduces ``model``'s forward (`rlhf.fastpaths.llama_like`)."""
    return llama_like(model)


class LeanDecodeUnsupported(Exception):
    """The model or the installed transformers lacks an internal the lean step uses (`llama_like`)."""


class LeanDecoder:
    """Decode steps of ``model`` after a prefill whose ``DynamicCache`` it takes over."""

    def __init__(self, model: Any, cache: Any, key_mask: torch.Tensor, new_tokens: int,
                 source: torch.Tensor | None = None, pack_head: bool = False, block_head: bool = False):
        """``cache``: the prefill's ``DynamicCache``, one row per distinct prompt (U rows);
        ``key_mask`` (U, P): 1 on the prompts' real tokens; ``new_tokens``: decode steps to hold;
        ``source`` (B,): the prompt each decoded row continues (None: row b continues prompt b);
        ``pack_head``: the output layer's weight laid out once for the decode where that pays
        (`rlhf.fastpaths.packed_head`); ``block_head``: else the output layer as blocks of W·hᵀ where that
        pays (`rlhf.fastpaths.blocked_head`).

        The prompts' keys and values stay one per prompt: when the rows are the prompts' samples
        in order, n each (``source`` = 0,0,..,1,1,..), a prompt's n rows read its cache together
        (n times less attention memory traffic over the prompt); otherwise each row gets a copy."""
        base = base_model(model)
        self.inner, self.head = base.model, base.lm_head
        self.rotate = [rotary_function(layer.self_attn) for layer in self.inner.layers]
        tensors = cache_tensors(cache)
        if tensors is None:
            raise LeanDecodeUnsupported("this transformers' DynamicCache keeps no per-layer keys and values")
        keys, values = tensors
        prompts = key_mask.shape[0]
        self.grouped = source is None or _in_groups(source, prompts)
        if not self.grouped:
            key_mask = key_mask[source]  # (B, P) a copy of the prompt per row
            self.prompt_keys = [k[source] for k in keys]  # (B, K, P, D) each
            self.prompt_values = [v[source] for v in values]
        else:
            self.prompt_keys = list(keys)  # (U, K, P, D) each
            self.prompt_values = list(values)
        self.prompts = key_mask.shape[0]  # U
        self.rows = len(source) if source is not None else self.prompts  # B
        self.prompt_valid = key_mask.bool()[:, None, None, :]  # (U, 1, 1, P)
        self.padded = not bool(key_mask.bool().all())  # no padding: no mask
        store = self.prompt_keys[0]
        shape = (self.rows, store.shape[1], new_tokens, store.shape[3])  # (B, K, N, D)
        self.own_dtype = own_cache_dtype(store)
        self.keys = [store.new_zeros(shape, dtype=self.own_dtype) for _ in self.inner.layers]
        self.values = [store.new_zeros(shape, dtype=self.own_dtype) for _ in self.inner.layers]
        self.length = 0  # tokens decoded so far
        self.output = (packed_head(self.head, self.rows, new_tokens) if pack_head else None) \
            or (blocked_head(self.head, self.rows) if block_head else None) or self.head

    @property
    def path(self) -> str:
        """Which of the step's variants runs: prompts padded or not, their caches shared by their
        rows or copied per row, the output layer as the layer's own product, laid out once or in
        blocks of W·hᵀ (each is checked against the forward on its own)."""
        head = "" if self.output is self.head else "/" + ("packed_head" if isinstance(self.output, PackedHead)
                                                          else "blocked_head")
        return f"lean_decode/{'padded' if self.padded else 'unpadded'}/{'grouped' if self.grouped else 'copied'}{head}"

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after feeding ``tokens`` (B,) at ``positions`` (B, 1) (their positions in their
        own rows); the token is cached at the next free slot. With the output layer in blocks the
        logits live in a buffer the next step writes again: read or copy them before stepping."""
        slot, length = self.length, self.length + 1
        hidden = self.inner.embed_tokens(tokens[:, None])  # (B, 1, hidden)
        cos, sin = self.inner.rotary_emb(hidden, positions)
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
            out = self._attend(index, query, length, attention.scaling)  # (B, H, D)
            hidden = residual + attention.o_proj(out.reshape(rows, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.length = length
        return self.output(self.inner.norm(hidden))[:, -1]  # (B, V)

    def _attend(self, index: int, query: torch.Tensor, length: int, scaling: float) -> torch.Tensor:
        """softmax(q·k / √D) v over the row's prompt and its ``length`` decoded tokens, (B, H, D).

        query (B, H, 1, D), H = K·g (grouped-query heads: head k·g + i reads key head k). The
        prompt part runs per prompt, its n rows' queries stacked against its one cache."""
        prompt_k, prompt_v = self.prompt_keys[index], self.prompt_values[index]  # (U, K, P, D)
        own_k, own_v = self.keys[index][:, :, :length], self.values[index][:, :, :length]  # (B, K, S, D)
        units, heads, prompt_len, size = prompt_k.shape
        rows, groups = query.shape[0], query.shape[1] // heads
        n = rows // units
        by_prompt = query.reshape(units, n, heads, groups, size).transpose(1, 2)  # (U, K, n, g, D)
        scores_prompt = torch.matmul(by_prompt.reshape(units, heads, n * groups, size),
                                     prompt_k.transpose(-1, -2))  # (U, K, n·g, P)
        if self.padded:
            scores_prompt = scores_prompt.masked_fill(~self.prompt_valid, float("-inf"))
        scores_prompt = scores_prompt.view(units, heads, n, groups, prompt_len).transpose(1, 2)  # (U, n, K, g, P)
        by_row = query.reshape(rows, heads, groups, size).to(self.own_dtype)  # (B, K, g, D)
        scores_own = torch.matmul(by_row, own_k.transpose(-1, -2)).to(query.dtype)  # (B, K, g, S)
        scores = torch.cat([scores_prompt.reshape(rows, heads, groups, prompt_len), scores_own], dim=-1)
        probs = torch.softmax(scores.float() * scaling, dim=-1).to(query.dtype)  # (B, K, g, P + S)
        probs_prompt = probs[..., :prompt_len].reshape(units, n, heads, groups, prompt_len).transpose(1, 2)
        out_prompt = torch.matmul(probs_prompt.reshape(units, heads, n * groups, prompt_len), prompt_v)  # (U, K, n·g, D)
        out_prompt = out_prompt.view(units, heads, n, groups, size).transpose(1, 2)  # (U, n, K, g, D)
        out_own = torch.matmul(probs[..., prompt_len:].to(self.own_dtype), own_v).to(query.dtype)  # (B, K, g, D)
        out = out_prompt.reshape(rows, heads, groups, size) + out_own  # (B, K, g, D)
        return out.reshape(rows, heads * groups, size)  # (B, H, D)


def own_cache_dtype(store: torch.Tensor) -> torch.dtype:
    """The dtype of the rows' own keys and values: the model's, except float32 for bfloat16 and
    float16 on a CPU.

    Their products with the query (one per decoded token, over a length that grows by one each
    step) are then MKL's float32 products rather than oneDNN's half-precision ones. oneDNN compiles
    and keeps a kernel for every distinct shape it sees, about 0.7 MB each in a cache of up to 1,024:
    a bfloat16 decode of 512 tokens grew a process by about 700 MB and spent a third of its first
    decode compiling, and past 512 tokens (two products a step) the cache evicts and compiles again
    on every step. The values agree to rounding: a half-precision key or value is exact in float32,
    both kinds of product accumulate in float32, and the results are rounded back to the model's
    dtype (only the order of the additions may differ). The cost is the own caches at twice the
    size."""
    half = (torch.bfloat16, torch.float16)
    return torch.float32 if store.device.type == "cpu" and store.dtype in half else store.dtype


def _in_groups(source: torch.Tensor, prompts: int) -> bool:
    """Whether ``source`` (B,) lists each of ``prompts`` prompts the same number of times, in order."""
    rows = source.numel()
    return rows % prompts == 0 and torch.equal(
        source.cpu(), torch.arange(prompts).repeat_interleave(rows // prompts))
