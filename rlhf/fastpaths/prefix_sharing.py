"""Prefix sharing: sequences that begin with the same tokens run through a causal LM as one row.

A group of rows (a DPO pair's chosen and rejected, the n samples of one prompt) shares its
longest common prefix, usually the prompt. ``share_prefixes`` lays each group out as one row:
the prefix once, then every row's remainder after it::

    prefix p0 p1 p2 | row a: a3 a4 | row b: b3 b4 b5
    positions 0 1 2 |         3  4 |         3  4  5

with a mask under which a token attends to the prefix and to the earlier tokens of its own
remainder, never to another row's. Each row then sees exactly the context and positions it has
alone, so the logits equal the unshared forward's up to float rounding, and the model runs the
prefix once instead of once per row (a DPO pair of prompt P and responses C1, C2: P + C1 + C2
tokens instead of 2P + C1 + C2; benchmarks/README.md has the figures).

The mask is a (G, 1, L, L) tensor handed to the model as ``attention_mask``; transformers'
models take such a 4D mask as given with the ``sdpa`` and ``eager`` attention implementations
(boolean for sdpa, additive for eager). Flash-attention takes no custom mask, so those models
are not shared (`can_share`): use ``--packing`` there.

Packed (``--packing``, a `rlhf.fastpaths.packing.PackedModel` of a Llama-architecture model) the
group rows lose their padding too: their real tokens run as one row through the norms,
projections and MLPs, and attention (masked, or per segment) reads them at their places in the rows' layout
(``prefix_sharing/packed/masked`` or ``/segment``, each checked on its own first use). A packed
model of another architecture runs its sequences packed and unshared.

Shape legend: ``B`` rows, ``T`` tokens, ``A = T - 1`` predicted positions, ``G`` groups, ``L``
tokens of the longest group row, ``K`` predicted tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from rlhf.core.logprobs import deferred_head, hidden_states_out, scatter_logprobs
from rlhf.core.modeling import accepts_logits_to_keep, base_model, innermost
from rlhf.core.ordered_gather import gather_rows
from rlhf.fastpaths.packing import is_packed
from rlhf.fastpaths.segment_attention import (SegmentLayout, segment_forward_supported, segment_layout,
                                              segments_pay, shared_forward_hidden)
from rlhf.fastpaths.verdicts import settle, verdict

_MASKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class SharedRows:
    input_ids: torch.Tensor  # (G, L) each group's prefix, then its rows' remainders; padded on the right
    position_ids: torch.Tensor  # (G, L) a token's position in its own row
    allowed: torch.Tensor  # (G, L, L) query attends key: the prefix and its own remainder, causally
    index: torch.Tensor  # (B, T) where each real token sits in the flattened (G·L) rows; -1 on padding
    segments: torch.Tensor  # (G, L) 0 on the prefix, k on the k-th row's remainder, -1 on padding

    @cached_property
    def layout(self) -> SegmentLayout:
        """Where the prefix and each remainder lie (`segment_layout` of ``segments``), worked out once."""
        return segment_layout(self.segments)

    @cached_property
    def real(self) -> torch.Tensor:
        """(N,) the flattened (G·L) positions of the rows' real tokens, in order: the rows packed."""
        return (self.segments.reshape(-1) >= 0).nonzero().squeeze(1)

    @cached_property
    def packed_at(self) -> torch.Tensor:
        """(G·L,) a flattened position's place among the real tokens (`real`); -1 on padding."""
        valid = self.segments.reshape(-1) >= 0  # (G·L,)
        return torch.where(valid, torch.cumsum(valid.long(), dim=0) - 1, -1)


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every row of ``rows`` has in common."""
    shortest = min(len(row) for row in rows)
    for length in range(shortest):
        token = rows[0][length]
        if any(row[length] != token for row in rows[1:]):
            return length
    return shortest


def share_prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   groups: Sequence[Sequence[int]]) -> SharedRows:
    """Lay out (B, T) rows, padded on either side, as one row per group of ``groups`` (lists of row
    indices, together covering every row once), each group's common prefix run once."""
    real = attention_mask.bool().cpu()  # (B, T)
    ids = input_ids.cpu()
    tokens = [ids[row][real[row]].tolist() for row in range(ids.shape[0])]
    group_ids, group_pos, group_seg = [], [], []
    slots: dict[int, tuple[int, int, int]] = {}  # row -> (group, shared, offset): token i at i, or offset + i - shared
    for g, members in enumerate(groups):
        shared = common_prefix([tokens[row] for row in members])
        row_ids, pos, seg = list(tokens[members[0]][:shared]), list(range(shared)), [0] * shared
        for order, row in enumerate(members, start=1):
            rest = tokens[row][shared:]
            slots[row] = (g, shared, len(row_ids))
            row_ids += rest
            pos += range(shared, shared + len(rest))
            seg += [order] * len(rest)
        group_ids.append(row_ids)
        group_pos.append(pos)
        group_seg.append(seg)
    length = max(len(row) for row in group_ids)
    count = len(groups)
    out_ids = torch.zeros((count, length), dtype=ids.dtype)  # (G, L)
    positions = torch.zeros((count, length), dtype=torch.long)  # (G, L)
    segments = torch.full((count, length), -1, dtype=torch.long)  # (G, L) 0 prefix, k row k's remainder, -1 pad
    for g in range(count):
        n = len(group_ids[g])
        out_ids[g, :n] = torch.tensor(group_ids[g], dtype=ids.dtype)
        positions[g, :n] = torch.tensor(group_pos[g])
        segments[g, :n] = torch.tensor(group_seg[g])
    valid = segments >= 0  # (G, L)
    query_seg, key_seg = segments[:, :, None], segments[:, None, :]  # (G, L, 1), (G, 1, L)
    allowed = (valid[:, :, None] & valid[:, None, :] & (positions[:, None, :] <= positions[:, :, None])
               & ((key_seg == 0) | (key_seg == query_seg)))  # (G, L, L)
    allowed |= torch.eye(length, dtype=torch.bool)[None]  # padding attends itself: no all-masked row
    index = torch.full(ids.shape, -1, dtype=torch.long)  # (B, T)
    for row, (g, shared, offset) in slots.items():
        slot = torch.arange(len(tokens[row]))  # (n,) the row's real tokens in order
        slot = torch.where(slot < shared, slot, slot + (offset - shared))  # (n,)
        index[row, real[row]] = g * length + slot
    device = input_ids.device
    return SharedRows(input_ids=out_ids.to(device), position_ids=positions.to(device), allowed=allowed.to(device),
                      index=index.to(device), segments=segments.to(device))


def can_share(model: Any) -> bool:
    """Whether ``model`` takes a custom 4D attention mask (transformers' sdpa or eager attention);
    packed (``--packing``), whether its rows can run packed and shared (`packed_sharing`)."""
    if is_packed(model):
        return packed_sharing(model)
    config = getattr(innermost(model), "config", None)
    return getattr(config, "_attn_implementation", None) in _MASKED_ATTENTION


def attention_mask_4d(model: Any, allowed: torch.Tensor) -> torch.Tensor:
    """(G, 1, L, L) mask for ``model``: boolean for sdpa, 0 / dtype-min added to the scores otherwise."""
    inner = innermost(model)
    if inner.config._attn_implementation == "sdpa":
        return allowed[:, None]
    dtype = next(inner.parameters()).dtype
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)  # (G, L, L)
    return blocked.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def packed_sharing(model: Any) -> bool:
    """Whether a packed model's (`rlhf.fastpaths.packing.PackedModel`) shared rows can run packed:
    the model it wraps runs `shared_forward_hidden` (Llama-architecture, not wrapped for data
    parallelism)."""
    wrapped = model.model
    return innermost(wrapped) is base_model(wrapped) and segment_forward_supported(wrapped)


def sharing_path(model: Any, rows: SharedRows) -> str:
    """The forward `shared_logits_at` runs for ``rows``: ``prefix_sharing/packed/masked`` or
    ``/segment`` (a packed model: the rows' real tokens as one row, attention under the rows' mask
    or per segment where that pays; each variant checked on its own), ``prefix_sharing/segment`` (attention
    per segment: a Llama-architecture model not wrapped for data parallelism, where it pays) or
    ``prefix_sharing/masked`` (the model's own forward under the row's mask)."""
    if is_packed(model):
        return f"prefix_sharing/packed/{'segment' if segments_pay(rows.layout) else 'masked'}"
    if innermost(model) is base_model(model) and segment_forward_supported(model) and \
            segments_pay(rows.layout):
        return "prefix_sharing/segment"
    return "prefix_sharing/masked"


def shared_logits_at(model: Any, rows: SharedRows, flat: torch.Tensor) -> torch.Tensor:
    """(K, V) logits at the flattened positions ``flat`` (K,) of ``rows``; only those positions'
    columns are projected to the vocabulary (none within a deferred head's ``hidden_states_out``:
    (K, H) hidden states). Gradients flow when enabled.

    The forward is the one `sharing_path` names: attention per segment
    (`rlhf.fastpaths.segment_attention`: the prefix's and each remainder's own scores, not the
    whole masked row's), over the rows' real tokens only when packed, or the model's forward under
    the row's mask."""
    path = sharing_path(model, rows)
    if path.startswith("prefix_sharing/packed/"):
        wrapped, real = model.model, rows.real
        allowed = rows.allowed if path.endswith("/masked") else None  # short rows: one masked call a layer
        hidden = shared_forward_hidden(wrapped, rows.input_ids.reshape(-1)[real][None],
                                       rows.position_ids.reshape(-1)[real][None], rows.layout, real,
                                       allowed)  # (1, N, hidden)
        return base_model(wrapped).lm_head(gather_rows(hidden[0], rows.packed_at[flat]))  # (K, V)
    if path == "prefix_sharing/segment":
        hidden = shared_forward_hidden(model, rows.input_ids, rows.position_ids, rows.layout)  # (G, L, hidden)
        return base_model(model).lm_head(gather_rows(hidden.reshape(-1, hidden.shape[-1]), flat))  # (K, V)
    length = rows.input_ids.shape[1]
    group, column = flat // length, flat % length  # (K,), (K,)
    needed = torch.unique(column)  # (C,) sorted columns some group needs logits at
    inner = innermost(model)
    kwargs = {"logits_to_keep": needed} if accepts_logits_to_keep(type(inner)) else {}
    logits = model(input_ids=rows.input_ids, position_ids=rows.position_ids,
                   attention_mask=attention_mask_4d(model, rows.allowed), use_cache=False, **kwargs).logits
    # a group's last prefix column is read once per row: a gather whose backward sums in order
    if kwargs:  # (G, C, V)
        at = group * needed.numel() + torch.searchsorted(needed, column)  # (K,) into the (G·C) rows
        return gather_rows(logits.reshape(-1, logits.shape[-1]), at)
    return gather_rows(logits.reshape(-1, logits.shape[-1]), flat)  # from (G, L, V)


def shared_token_logprobs(model: torch.nn.Module, rows: SharedRows, input_ids: torch.Tensor,
                          action_mask: torch.Tensor, *, temperature: float = 1.0,
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rlhf.core.logprobs.token_logprobs` of a (B, T) batch laid out by `share_prefixes` (rows of a
    group share their common prefix's forward), best of ``without_last_token(attention_mask)``: a
    row's last token predicts nothing. Log-probs (and entropy) (B, A) are 0 off the action mask;
    gradients flow when enabled."""
    batch_size, length = input_ids.shape  # (B, T)
    wanted = action_mask.bool() & (rows.index[:, :-1] >= 0)  # (B, A) an action token predicted from a laid-out one
    row, col = wanted.nonzero(as_tuple=True)  # (K,), (K,)
    targets = input_ids[row, col + 1]  # (K,)
    logprobs = torch.zeros((batch_size, length - 1), dtype=torch.float32, device=input_ids.device)  # (B, A)
    entropy = torch.zeros_like(logprobs) if with_entropy else None
    if row.numel() == 0:
        return logprobs, entropy
    head = deferred_head(model)
    with hidden_states_out(head):
        logits = shared_logits_at(model, rows, rows.index[row, col])  # (K, V), or (K, H) with a deferred head
    return scatter_logprobs(logits, targets, (row, col), logprobs, entropy, temperature, head)


def checked_for_sharing(model: Any, rows: SharedRows, shared: Callable[[], torch.Tensor],
                        separate: Callable[[], torch.Tensor], who: str) -> bool:
    """Whether ``model`` may run ``rows`` shared. The first time each `sharing_path` runs on a model
    compares ``shared()`` and ``separate()``, (B, A) log-probs of the same tokens with and without
    sharing (`rlhf.fastpaths.verdicts`); they must agree up to float rounding (1e-3 nats per token
    in float32, 5e-2 in half precision). A model that ignores the 4D mask fails, with a warning
    naming ``who``; its sequences then run separately."""
    path = sharing_path(model, rows)
    owner = model.model if is_packed(model) else model  # a packed model's wrapper is made anew per step
    known = verdict(owner, path)
    if known is not None:
        return known
    was_training = model.training
    model.eval()  # no dropout: both forwards must see the same function
    try:
        with torch.no_grad():
            difference = float((shared() - separate()).abs().max())  # over (B, A)
    finally:
        model.train(was_training)
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    return settle(owner, path, difference, tolerance, who=who, switch="--no-share-prompt")
