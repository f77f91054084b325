"""Sample packing: a padded batch of sequences run through a causal LM as one row, no padding.

``pack_rows`` lays each row's real tokens (``attention_mask`` 1) end to end in one (1, N) row
with position ids that restart at 0 for every sequence. Given ``position_ids`` and no attention
mask, transformers (5.x) reads the restarts as sequence boundaries: flash-attention runs its
variable-length kernel, sdpa and eager get a block-diagonal causal mask, so attention stays
within each sequence. A row's real tokens must be contiguous (left and/or right padding), as in
every batch rlhf builds. Rotary position embeddings depend on position differences only, so
the result equals the padded forward's up to float rounding.

`PackedModel` wraps a model so that callers which pass padded (B, T) batches (the objectives'
forwards, `rlhf.core.logprobs.token_logprobs`) run packed; outputs come back padded to (B, T).

Shape legend: ``B`` sequences, ``T`` tokens, ``N`` real tokens in the batch, ``V`` vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from rlhf.core.modeling import base_model


@dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # (1, N) every row's real tokens, row after row
    position_ids: torch.Tensor  # (1, N) 0, 1, ... within each sequence
    index: torch.Tensor  # (B, T) where each real token sits in the packed row; -1 on padding


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack (B, T) right-, left- or both-side padded rows into one (1, N) row."""
    real = attention_mask.bool()  # (B, T)
    flat_index = torch.cumsum(real.reshape(-1).long(), dim=0).reshape(real.shape) - 1  # (B, T)
    index = torch.where(real, flat_index, torch.full_like(flat_index, -1))  # (B, T)
    positions = torch.cumsum(real.long(), dim=1) - 1  # (B, T) position within its own row
    return PackedRows(input_ids=input_ids[real][None, :], position_ids=positions[real][None, :], index=index)


def unpack(values: torch.Tensor, index: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """(1, N, ...) per packed token -> (B, T, ...) per padded position (``fill`` on padding)."""
    real = index >= 0  # (B, T)
    out = values.new_full((*index.shape, *values.shape[2:]), fill)  # (B, T, ...)
    out[real] = values[0, index[real]]
    return out


@lru_cache(maxsize=None)
def accepts_position_ids(forward_cls: type) -> bool:
    return "position_ids" in inspect.signature(forward_cls.forward).parameters


def innermost(model: Any) -> Any:
    """The model under training wrappers (DeepSpeed's engine, DDP: ``.module``) and PEFT's wrapper."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return base_model(model)


class PackedModel:
    """``model`` called with padded (B, T) batches, run packed (`pack_rows`) when it can be: a
    model whose forward takes ``position_ids`` (causal LMs); others (a value head) run padded.

    Everything but the call is the wrapped model's (``.config``, ``.train()``, ...).
    """

    def __init__(self, model: Any):
        self.model = model
        self.packs = accepts_position_ids(type(innermost(model)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        if not self.packs or attention_mask is None or input_ids is None or kwargs.get("past_key_values") is not None:
            return self.model(input_ids, attention_mask, **kwargs) if attention_mask is not None \
                else self.model(input_ids=input_ids, **kwargs)
        keep = kwargs.pop("logits_to_keep", 0)
        packed = pack_rows(input_ids, attention_mask)
        kwargs["use_cache"] = False  # with a cache transformers ignores the sequence boundaries
        output = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                            **kwargs)
        if isinstance(output, torch.Tensor):  # (1, N, ...) -> (B, T, ...)
            output = unpack(output, packed.index)
            return output[:, -keep:] if keep else output
        logits = unpack(output.logits, packed.index)  # (B, T, V)
        output.logits = logits[:, -keep:] if keep else logits
        return output


def is_packed(model: Any) -> bool:
    return isinstance(model, PackedModel) and model.packs


def token_budget_groups(lengths: list[int], max_tokens: int, *, rows: list[int] | None = None,
                        packed: bool = False) -> list[list[int]]:
    """Consecutive groups of items (in the given order) of at most ``max_tokens`` tokens each; an
    item over the budget alone. An item is ``rows[i]`` sequences (default 1) of at most ``lengths[i]``
    tokens, or ``lengths[i]`` tokens in all when ``packed`` (its real tokens). Padded, a group costs
    its rows x its longest sequence; packed, the sum of its tokens."""
    rows = rows if rows is not None else [1] * len(lengths)
    groups: list[list[int]] = []
    current: list[int] = []
    total = longest = count = 0
    for item, (length, n_rows) in enumerate(zip(lengths, rows)):
        if packed:
            cost = total + length
        else:
            cost = (count + n_rows) * max(longest, length)
        if current and cost > max_tokens:
            groups.append(current)
            current, total, longest, count = [], 0, 0, 0
        current.append(item)
        total, longest, count = total + length, max(longest, length), count + n_rows
    if current:
        groups.append(current)
    return groups
