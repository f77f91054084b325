"""Attention over prefix-shared rows, one segment at a time: the work of separate rows, not of one long row.

A group row of `rlhf.fastpaths.prefix_sharing` holds a prefix, then the remainders (segments) of the
group's n rows. Under its mask a prefix token sees the prefix causally and a segment token sees the
whole prefix and its own segment causally, so dense attention over the row computes (P + n·S)²
scores, most of them masked: 2.5x the scores of the n separate rows for a 128-token prompt and
eight 128-token samples. Here each piece attends only to what it sees:

    prefix  p:  softmax(q_p·k_pᵀ·s + causal) v_p                       (G, H, P, D)
    segment j:  softmax([q_j·k_pᵀ, q_j·k_jᵀ + causal]·s) [v_p; v_j]    (G, H, n, S, D)

which is P²/2 + n·S·(P + S/2) scores, fewer than the separate rows' n·(P + S)²/2. The result
equals sdpa under the row's mask to float rounding (tests/fastpaths/test_segment_attention.py);
padding positions, which nothing reads, get zeros.

`shared_forward_hidden` runs a Llama-architecture model (`rlhf.fastpaths.llama_like`) over
shared rows with its own modules in its forward's order and this attention in place of the
model's; `rlhf.fastpaths.prefix_sharing.shared_logits_at` uses it where the model allows it and it
pays (`segments_pay`: two attention calls and their gathers cost about as much as 32k masked
scores per head on a CPU, so short rows such as DPO pairs keep the single masked call).

Shape legend: ``G`` group rows, ``L`` their length, ``P`` the longest prefix, ``n`` segments per
group at most, ``S`` the longest segment, ``H``/``K`` query/key-value heads, ``D`` head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf.core.modeling import base_model
from rlhf.core.ordered_gather import gather_rows
from rlhf.fastpaths.llama_like import llama_like, rotary_function


@dataclass(frozen=True)
class SegmentLayout:
    prefix_valid: torch.Tensor  # (G, P) a real prefix token at column p
    segment_at: torch.Tensor  # (G, n, S) the column of segment j's s-th token; 0 where there is none
    segment_valid: torch.Tensor  # (G, n, S) segment j has an s-th token
    length: int  # L


def segment_layout(segments: torch.Tensor) -> SegmentLayout:
    """Where each piece of ``segments`` (G, L) lies: 0 on the prefix (the first columns), k ≥ 1 on
    segment k (contiguous), -1 on padding."""
    groups, length = segments.shape
    prefix_len = (segments == 0).sum(dim=1)  # (G,)
    longest_prefix = max(int(prefix_len.max()), 1)
    prefix_valid = torch.arange(longest_prefix, device=segments.device)[None] < prefix_len[:, None]  # (G, P)
    count = max(int(segments.max()), 1)
    ids = torch.arange(1, count + 1, device=segments.device)  # (n,)
    member = segments[:, None, :] == ids[None, :, None]  # (G, n, L)
    sizes = member.sum(dim=2)  # (G, n)
    longest = max(int(sizes.max()), 1)
    starts = torch.where(sizes > 0, member.int().argmax(dim=2), 0)  # (G, n) a segment's first column
    offsets = torch.arange(longest, device=segments.device)  # (S,)
    segment_valid = offsets[None, None] < sizes[:, :, None]  # (G, n, S)
    segment_at = torch.where(segment_valid, starts[:, :, None] + offsets[None, None], 0)  # (G, n, S)
    return SegmentLayout(prefix_valid=prefix_valid, segment_at=segment_at, segment_valid=segment_valid,
                         length=length)


SEGMENTS_PAY_FROM = 32_768  # masked scores per head a micro-batch must save (measured on CPU, benchmarks/README.md)


def segments_pay(layout: SegmentLayout) -> bool:
    """Whether attention per segment saves at least `SEGMENTS_PAY_FROM` of the scores a masked
    attention over the whole rows computes: G·L² against G·(P² + n·S·(P + S)), padded sizes."""
    groups, count, longest = layout.segment_at.shape
    prefix = layout.prefix_valid.shape[1]
    dense = groups * layout.length ** 2
    pieces = groups * (prefix ** 2 + count * longest * (prefix + longest))
    return dense - pieces >= SEGMENTS_PAY_FROM


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SegmentLayout,
                      scaling: float) -> torch.Tensor:
    """Attention of the laid-out rows, query (G, H, L, D), key and value (G, K, L, D) with H = K·g
    (query head h reads key head h // g). Returns (G, L, H, D), zeros on padding.

    Two sdpa calls: the prefix over itself, and every segment as a row of its own over its
    prefix's keys followed by its own (the prefix's keys and values copied per segment)."""
    groups, heads, length, size = query.shape
    kv_heads = key.shape[1]
    prefix = layout.prefix_valid.shape[1]
    count, longest = layout.segment_at.shape[1:]
    device, grouped = query.device, kv_heads != heads

    # the prefix over itself, causally; a group whose prefix is shorter than P computes garbage past
    # it (each query at least sees itself: no all-masked row), which is not written back
    causal = torch.ones(prefix, prefix, dtype=torch.bool, device=device).tril()  # (P, P)
    seen = (layout.prefix_valid[:, None, :] & causal) | torch.eye(prefix, dtype=torch.bool, device=device)  # (G, P, P)
    out_prefix = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, :prefix], key[:, :, :prefix], value[:, :, :prefix], attn_mask=seen[:, None], scale=scaling,
        enable_gqa=grouped)  # (G, H, P, D)

    # each segment a row of its own: queries (G·n, H, S, D) over [prefix; itself] (G·n, K, P + S, D)
    starts = torch.arange(groups, device=device)[:, None, None] * length  # (G, 1, 1)
    at = (starts + layout.segment_at).reshape(-1)  # (G·n·S,) into the (G·L) tokens

    def pieces(states: torch.Tensor) -> torch.Tensor:  # (G, h, L, D) -> (G, n, S, h, D)
        tokens = states.transpose(1, 2).reshape(groups * length, -1, size)  # (G·L, h, D)
        return gather_rows(tokens, at).view(groups, count, longest, -1, size)  # padding slots repeat column 0

    def with_prefix(states: torch.Tensor) -> torch.Tensor:  # (G, K, L, D) -> (G·n, K, P + S, D)
        shared = states[:, :, :prefix].transpose(1, 2)[:, None].expand(groups, count, prefix, kv_heads, size)
        both = torch.cat([shared, pieces(states)], dim=2)  # (G, n, P + S, K, D)
        return both.reshape(groups * count, prefix + longest, kv_heads, size).transpose(1, 2)

    own = torch.ones(longest, longest, dtype=torch.bool, device=device).tril() & layout.segment_valid[:, :, None, :]
    own |= torch.eye(longest, dtype=torch.bool, device=device)  # (G, n, S, S) padding slots see themselves
    to_prefix = layout.prefix_valid[:, None, None, :].expand(groups, count, longest, prefix)  # (G, n, S, P)
    mask = torch.cat([to_prefix, own], dim=-1).reshape(groups * count, 1, longest, prefix + longest)
    queries = pieces(query).reshape(groups * count, longest, heads, size).transpose(1, 2)  # (G·n, H, S, D)
    out_segments = torch.nn.functional.scaled_dot_product_attention(
        queries, with_prefix(key), with_prefix(value), attn_mask=mask, scale=scaling,
        enable_gqa=grouped)  # (G·n, H, S, D)

    # back to the rows' columns, (G·L, H, D) written at the real prefix and segment tokens
    rows = torch.arange(groups, device=device)[:, None] * length  # (G, 1)
    prefix_at = (rows + torch.arange(prefix, device=device)[None])[layout.prefix_valid]  # (real prefix tokens,)
    segment_at = (rows[:, :, None] + layout.segment_at)[layout.segment_valid]  # (real segment tokens,)
    by_segment = out_segments.transpose(1, 2).reshape(groups, count, longest, heads, size)
    out = query.new_zeros(groups * length, heads, size)
    out = out.index_put((prefix_at,), out_prefix.transpose(1, 2)[layout.prefix_valid])
    out = out.index_put((segment_at,), by_segment[layout.segment_valid])
    return out.view(groups, length, heads, size)


def segment_forward_supported(model: Any) -> bool:
    """Whether `shared_forward_hidden` reproduces ``model``'s forward: Llama-like, no attention
    dropout in training, no gradient checkpointing (the model's layers would recompute with its
    own attention)."""
    if not llama_like(model):
        return False
    base = base_model(model)
    if base.training and float(getattr(base.config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    flagged = (base, base.model, *base.model.layers)  # where transformers sets the flag (its modules that have one)
    return not any(getattr(module, "gradient_checkpointing", False) for module in flagged)


def shared_forward_hidden(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                          layout: SegmentLayout, real: torch.Tensor | None = None,
                          allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The final-norm hidden states of laid-out rows: ``input_ids`` and ``position_ids`` (G, L) as
    `rlhf.fastpaths.prefix_sharing.share_prefixes` makes them, ``layout`` `segment_layout` of their
    segments; (G, L, hidden). Packed (``real`` (N,), the flattened (G·L) positions of the rows'
    real tokens, and ``input_ids``, ``position_ids`` (1, N) those tokens): the norms, projections
    and MLPs run over the N real tokens only, attention over the rows' layout (queries, keys and
    values placed at their columns, zeros on padding, which nothing reads); (1, N, hidden).
    Attention is per segment, or with ``allowed`` (G, L, L) one sdpa call under that mask (short
    rows, where two calls cost more than the masked scores: `segments_pay`).
    Gradients flow when enabled; LoRA-wrapped projections run as they are."""
    inner = base_model(model).model
    hidden = inner.embed_tokens(input_ids)  # (G, L, hidden), or (1, N, hidden) packed
    cos, sin = inner.rotary_emb(hidden, position_ids)
    rows, columns = input_ids.shape
    groups, length = layout.prefix_valid.shape[0], layout.length
    for layer in inner.layers:
        attention = layer.self_attn
        rotate = rotary_function(attention)
        x = layer.input_layernorm(hidden)  # (rows, columns, hidden)
        shape = (rows, columns, -1, attention.head_dim)
        query = attention.q_proj(x).view(shape).transpose(1, 2)  # (rows, H, columns, D)
        key = attention.k_proj(x).view(shape).transpose(1, 2)  # (rows, K, columns, D)
        value = attention.v_proj(x).view(shape).transpose(1, 2)  # (rows, K, columns, D)
        query, key = rotate(query, key, cos, sin)
        if real is not None:  # (1, h, N, D) -> (G, h, L, D)
            query, key, value = (_at_columns(states, real, groups, length) for states in (query, key, value))
        if allowed is None:
            out = segment_attention(query, key, value, layout, attention.scaling)  # (G, L, H, D)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=allowed[:, None], scale=attention.scaling,
                enable_gqa=key.shape[1] != query.shape[1]).transpose(1, 2)  # (G, L, H, D)
        if real is not None:
            out = gather_rows(out.reshape(groups * length, -1), real)  # (N, H·D)
        hidden = hidden + attention.o_proj(out.reshape(rows, columns, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return inner.norm(hidden)


def _at_columns(states: torch.Tensor, real: torch.Tensor, groups: int, length: int) -> torch.Tensor:
    """Packed (1, h, N, D) states placed at their (G·L) positions ``real`` (N,): (G, h, L, D), zeros
    elsewhere."""
    tokens = states[0].transpose(0, 1)  # (N, h, D)
    placed = tokens.new_zeros(groups * length, *tokens.shape[1:]).index_put((real,), tokens)  # (G·L, h, D)
    return placed.view(groups, length, *tokens.shape[1:]).transpose(1, 2)
