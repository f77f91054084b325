"""Sample packing: a padded batch of sequences run through a causal LM as one row, no padding.

``pack_rows`` lays each row's real tokens (``attention_mask`` 1) end to end in one (1, N) row
with position ids that restart at 0 for every sequence. Given ``position_ids`` and no attention
mask, transformers (5.x) reads the restarts as sequence boundaries: flash-attention runs its
variable-length kernel, sdpa and eager get a block-diagonal causal mask, so attention stays
within each sequence. A row's real tokens must be contiguous (left and/or right padding), as in
every batch rlhf builds. Rotary position embeddings depend on position differences only, so
the result equals the padded forward's up to float rounding.

On a Llama-architecture model (`rlhf.fastpaths.llama_like`, sdpa, no gradient checkpointing) the
log-prob forward attends one sequence at a time instead (`rlhf.fastpaths.segment_attention`, the
packed row laid out as segments with no shared prefix): the block-diagonal mask makes sdpa compute
all N² scores of the packed row, most of them masked, where the sequences alone need about
B·S²; on a CPU that made a packed SFT step slower than a padded one (benchmarks/README.md). It is
used where it saves at least `segments_pay`'s share of the scores.

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

from rlhf.core.logprobs import (OwnLogprobs, deferred_head, hidden_states_out, scatter_logprobs, token_logprobs,
                                without_last_token)
from rlhf.core.modeling import accepts_logits_to_keep, base_model, innermost
from rlhf.core.ordered_gather import gather_rows
from rlhf.fastpaths.segment_attention import (segment_forward_supported, segment_layout, segments_pay,
                                              shared_forward_hidden)
from rlhf.fastpaths.verdicts import settle, verdict


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


class PackedModel(OwnLogprobs):
    """``model`` called with padded (B, T) batches, run packed (`pack_rows`) when it can be: a
    model whose forward takes ``position_ids`` (causal LMs); others (a value head) run padded.

    Everything but the call is the wrapped model's (``.config``, ``.train()``, ...).
    """

    def __init__(self, model: Any):
        self.model = model
        self.packs = accepts_position_ids(type(innermost(model)))

    @property
    def runs_own_logprobs(self) -> bool:
        return self.packs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        cached = any(kwargs.get(name) is not None for name in ("cache", "past_key_values"))  # a decode step
        if not self.packs or attention_mask is None or input_ids is None or cached:
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

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, *,
                       temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`rlhf.core.logprobs.token_logprobs` with the batch packed into one row: only the action
        positions are projected to the vocabulary, and rows' last tokens are left out of the pack.
        Log-probs (and entropy) are 0 off the action mask. The first call per model and variant
        (`packing_path`) compares them with the padded forward's (1e-3 nats per token in float32,
        5e-2 in half precision)."""
        path = packing_path(self.model, input_ids, attention_mask)  # each variant checked on its own first use
        if verdict(self.model, path) is None:
            was_training = self.model.training
            self.model.eval()  # no dropout: both forwards must see the same function
            try:
                with torch.no_grad():
                    packed, _ = _packed_logprobs(self.model, input_ids, attention_mask, action_mask, temperature)
                    padded, _ = token_logprobs(self.model, input_ids, attention_mask, action_mask,
                                               temperature=temperature)
                    difference = float(((packed - padded) * action_mask[:, : packed.shape[1]]).abs().max())
            finally:
                self.model.train(was_training)
            tolerance = 1e-3 if next(self.model.parameters()).dtype == torch.float32 else 5e-2
            settle(self.model, path, difference, tolerance, who="packing", switch="--no-packing")
        if not verdict(self.model, path):  # found to differ: the wrapped model's padded forward
            return token_logprobs(self.model, input_ids, attention_mask, action_mask, temperature=temperature,
                                  with_entropy=with_entropy)
        return _packed_logprobs(self.model, input_ids, attention_mask, action_mask, temperature, with_entropy)


def _packed_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
                     temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch_size, length = input_ids.shape  # (B, T)
    packed = pack_rows(input_ids, without_last_token(attention_mask))
    wanted = action_mask.bool() & (packed.index[:, :-1] >= 0)  # (B, A) an action token predicted from a packed one
    rows, cols = wanted.nonzero(as_tuple=True)  # (K,), (K,)
    at = packed.index[rows, cols]  # (K,) packed positions whose logits predict the action tokens
    targets = input_ids[rows, cols + 1]  # (K,)
    logprobs = torch.zeros((batch_size, length - 1), dtype=torch.float32, device=input_ids.device)  # (B, A)
    entropy = torch.zeros_like(logprobs) if with_entropy else None
    if at.numel() == 0:
        return logprobs, entropy
    head = deferred_head(model)
    layout = _per_sequence_layout(model, packed)
    if layout is not None:  # attention one sequence at a time, only the wanted positions projected
        with hidden_states_out(head):
            hidden = shared_forward_hidden(model, packed.input_ids, packed.position_ids, layout)  # (1, N, hidden)
            logits = base_model(model).lm_head(gather_rows(hidden[0], at))  # (K, V), or (K, H) deferred
        return scatter_logprobs(logits, targets, (rows, cols), logprobs, entropy, temperature, head)
    kwargs = {"logits_to_keep": at} if accepts_logits_to_keep(type(innermost(model))) else {}
    with hidden_states_out(head):  # with a deferred head: hidden states (…, H) instead of logits
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                       use_cache=False, **kwargs).logits  # (1, K, V) or (1, N, V)
    logits = logits[0] if kwargs else logits[0, at]  # (K, V)
    return scatter_logprobs(logits, targets, (rows, cols), logprobs, entropy, temperature, head)


def packing_path(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    """The verdict name of the packed log-prob forward these rows take on ``model``:
    ``packing/segments`` (attention one sequence at a time) or ``packing/masked`` (one
    block-diagonal mask over the packed row)."""
    packed = pack_rows(input_ids, without_last_token(attention_mask))
    return "packing/segments" if _per_sequence_layout(model, packed) is not None else "packing/masked"


def _per_sequence_layout(model: Any, packed: PackedRows) -> Any:
    """The packed row as `segment_attention` segments (sequence k is segment k + 1, no shared prefix)
    when ``model`` runs that forward and it saves enough scores, else None."""
    if innermost(model) is not base_model(model) or not segment_forward_supported(model):
        return None
    starts = (packed.position_ids[0] == 0).long()  # (N,) 1 where a sequence begins
    layout = segment_layout(torch.cumsum(starts, dim=0)[None])  # (1, N) segment ids 1..B
    return layout if segments_pay(layout) else None


def is_packed(model: Any) -> bool:
    return isinstance(model, PackedModel) and model.packs
