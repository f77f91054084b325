"""Process reward models: a causal LM that scores each step of a solution at a placeholder token.

``prm_loss`` (OpenRLHF's ``PRMLoss``, after Math-Shepherd, Wang et al. 2023, arXiv:2312.08935):
only the positions where the input holds the placeholder token count. With ``reward_token_ids``
the logits there are restricted to those tokens (e.g. "+" and "-"); hard labels (token ids) become
their index in that list, soft labels (floats, the probability of the first reward token) become
the distribution [p, 1 − p]. Cross-entropy, mean over placeholder positions (label -100 ignored);
the accuracy is the share of positions whose argmax is the label's.

Shape legend: ``B`` sequences, ``T`` tokens, ``V`` vocabulary, ``P`` placeholder positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100


def prm_loss(input_ids: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, *, placeholder_token_id: int,
             reward_token_ids: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy at the placeholder positions and the accuracy there.

    input_ids (B, T); logits (B, T, V) at each input position; labels (B, T): at placeholders the
    reward token id (hard) or a float probability of the first reward token (soft; needs two
    ``reward_token_ids``), -100 elsewhere. Returns ``(loss (), accuracy ())``.
    """
    placeholders = input_ids == placeholder_token_id  # (B, T)
    return prm_loss_at(logits[placeholders], labels[placeholders], reward_token_ids=reward_token_ids)


def prm_loss_at(logits: torch.Tensor, labels: torch.Tensor, *,
                reward_token_ids: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`prm_loss` given the placeholder positions' logits (P, V) and labels (P,) only (a model that
    projects only those positions to the vocabulary: `rlhf.core.logprobs.DeferredHead`)."""
    import torch
    import torch.nn.functional as F

    if labels.dtype == torch.float:
        if reward_token_ids is None or len(reward_token_ids) != 2:
            raise ValueError("soft (probability) labels need exactly two reward_token_ids")
        logits = logits[..., list(reward_token_ids)]  # (P, 2)
        positive = labels.to(logits.dtype)  # (P,)
        negative = 1 - positive
        negative[positive != IGNORE_INDEX] = 1 - positive[positive != IGNORE_INDEX]
        labels = torch.stack([positive, negative], dim=-1)  # (P, 2)
    elif reward_token_ids is not None:
        logits = logits[..., list(reward_token_ids)]  # (P, R)
        for index, token in enumerate(reward_token_ids):
            labels = torch.where(labels == token, index, labels)  # (P,) token ids -> index among the reward tokens
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    if labels.dtype == logits.dtype:
        labels = labels.argmax(dim=-1)  # (P,)
    accuracy = (logits.argmax(dim=-1) == labels).float().mean()
    return loss, accuracy
