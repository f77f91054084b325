"""Token-level language-model losses: supervised fine-tuning and knowledge distillation.

* ``sft_loss``: −mean over labelled positions of log p(token_{t+1} | ≤ t) (OpenRLHF's ``GPTLMLoss``,
  i.e. ``nn.CrossEntropyLoss(ignore_index=-100)`` on shifted logits and labels).
* ``distillation_loss``: −Σ_t m_t Σ_v p_teacher(v) log p_student(v) / Σ_t m_t, the cross-entropy of
  the student to the teacher's distribution (forward KL up to the teacher's entropy), positions
  whose student logit is ±inf contributing nothing (OpenRLHF's ``KDLoss``, after MiniLLM).

Shape legend: ``B`` sequences, ``T`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over the positions whose label is not -100.

    logits (B, T, V); labels (B, T) token ids, -100 where nothing is learnt (prompt, padding).
    Position t predicts token t + 1: logits[:, :-1] are scored against labels[:, 1:].
    """
    import torch.nn.functional as F

    shifted_logits = logits[..., :-1, :].contiguous()  # (B, T-1, V)
    shifted_labels = labels[..., 1:].contiguous()  # (B, T-1)
    return F.cross_entropy(shifted_logits.view(-1, shifted_logits.size(-1)), shifted_labels.view(-1),
                           ignore_index=IGNORE_INDEX)


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """−Σ_t m_t Σ_v softmax(teacher)_v · log_softmax(student)_v / Σ_t m_t, in float32.

    logits (B, T, V) student; teacher_logits (B, T, V); loss_mask (B, T): 1 at the positions whose
    prediction is distilled. Vocabulary entries where the student's logit is ±inf add nothing.
    """
    import torch
    import torch.nn.functional as F

    teacher_probs = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)  # (B, T, V)
    logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # (B, T, V)
    products = torch.masked_fill(teacher_probs * logprobs, torch.isinf(logits), 0)  # (B, T, V)
    per_position = products.sum(dim=-1).view(-1)  # (B·T,)
    mask = loss_mask.reshape(-1).to(per_position.dtype)  # (B·T,)
    return -(per_position * mask).sum() / mask.sum()


def sequence_logprobs(per_token_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed and mean log-prob over its masked tokens.

    per_token_logprobs, loss_mask (B, A). Returns ``(sums (B,), means (B,))``; a sequence without masked
    tokens has mean 0.
    """
    mask = loss_mask.to(per_token_logprobs.dtype)  # (B, A)
    sums = (per_token_logprobs * mask).sum(dim=-1)  # (B,)
    return sums, sums / mask.sum(dim=-1).clamp(min=1)
