"""Helpers for writing objectives: padding examples into micro-batches, and the two forwards the
built-ins use (per-token log-probs of the learnt tokens; a scalar head's score per sequence).

Micro-batches are right-padded: ``input_ids`` (B, T) with the pad token, ``attention_mask`` (B, T)
1 on real tokens, ``loss_mask`` (B, T) 1 on the tokens whose prediction is learnt. Token t is
predicted at position t - 1, so the action mask of ``rlhf.core.logprobs`` is ``loss_mask[:, 1:]``.

Shape legend: ``B`` sequences, ``T`` tokens, ``A = T - 1`` predicted positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rlhf.fastpaths.prefix_sharing import SharedRows


def pad_right(rows: Sequence[Sequence[int | float]], value: int | float, *, dtype: torch.dtype | None = None,
              width: int | None = None) -> torch.Tensor:
    """Rows of different lengths as one (B, T) tensor, padded on the right with ``value``."""
    import torch

    width = width if width is not None else max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype or torch.long)  # (B, T)
    for index, row in enumerate(rows):
        out[index, :len(row)] = torch.tensor(list(row), dtype=out.dtype)
    return out


def token_batch(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``[(ids, loss_mask), ...]`` -> ``input_ids``, ``attention_mask``, ``loss_mask``, each (B, T)."""
    import torch

    width = max(len(ids) for ids, _ in sequences)
    return {
        "input_ids": pad_right([ids for ids, _ in sequences], pad_token_id, width=width),  # (B, T)
        "attention_mask": pad_right([[1] * len(ids) for ids, _ in sequences], 0, width=width),  # (B, T)
        "loss_mask": pad_right([mask for _, mask in sequences], 0, dtype=torch.float32, width=width),  # (B, T)
    }


def response_mask(length: int, prompt_len: int) -> list[int]:
    """1 on the response tokens of a sequence whose first ``prompt_len`` tokens are the prompt."""
    return [0] * prompt_len + [1] * (length - prompt_len)


def learnt_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, A) log-probs of each learnt token under ``model``, 0 elsewhere (grad flows when enabled).

    input_ids, attention_mask, loss_mask (B, T); position t of the result scores token t + 1.
    """
    from rlhf.core.logprobs import token_logprobs

    action_mask = loss_mask[:, 1:]  # (B, A)
    logprobs, _ = token_logprobs(model, input_ids, attention_mask, action_mask)  # (B, A)
    return logprobs * action_mask


def shared_learnt_logprobs(model: torch.nn.Module, rows: SharedRows, input_ids: torch.Tensor,
                       loss_mask: torch.Tensor) -> torch.Tensor:
    """`learnt_logprobs` with groups of rows sharing their common prefix's forward: ``rows`` is
    `rlhf.fastpaths.prefix_sharing.share_prefixes` of this batch. (B, A), 0 off the learnt tokens."""
    from rlhf.fastpaths.prefix_sharing import shared_token_logprobs

    action_mask = loss_mask[:, 1:]  # (B, A)
    logprobs, _ = shared_token_logprobs(model, rows, input_ids, action_mask)  # (B, A)
    return logprobs * action_mask


def last_token_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) a scalar-head model's value at each sequence's last real token (any padding side).

    ``model(input_ids, attention_mask)`` returns a value per position (B, T), as a model of head
    ``score`` does.
    """
    from rlhf.core.masked import last_real_index

    values = model(input_ids, attention_mask)  # (B, T)
    last = last_real_index(attention_mask)  # (B,)
    return values.gather(1, last[:, None]).squeeze(1)  # (B,)
