"""Losses that learn from preferences: reward models, DPO and its variants, KTO.

* ``reward_model_loss``: pairwise Bradley-Terry, −mean log σ(r_c − r_r − margin) (``sigmoid``,
  OpenRLHF's ``PairWiseLoss``), or mean log(1 + exp(r_r − r_c)) (``logexp``, Askell et al. 2021,
  arXiv:2112.00861; OpenRLHF's ``LogExpLoss``, which takes no margin).
* ``dpo_loss``: with h = (log π(y_c) − log π(y_r)) − (log π_ref(y_c) − log π_ref(y_r)) over summed
  response log-probs: DPO (Rafailov et al. 2023, arXiv:2305.18290) −log σ(βh); cDPO with label
  smoothing ε: −(1 − ε) log σ(βh) − ε log σ(−βh); IPO (Azar et al. 2023, arXiv:2310.12036)
  (h − 1/(2β))². Implicit rewards β(log π − log π_ref), detached. OpenRLHF's ``DPOLoss``.
* ``kto_loss``: KTO (Ethayarajh et al. 2024, arXiv:2402.01306) for uneven numbers of desirable
  and undesirable samples: z = max(0, mean(log π − log π_ref) over mismatched KL pairs), detached;
  desirable 1 − σ(β(r − z)), undesirable 1 − σ(β(z − r)), weighted, mean over all samples.
  OpenRLHF's ``KTOLoss`` in one process (its all-reduce of z is the fit loop's job: it passes the
  whole step's KL samples).

Shape legend: ``B`` pairs or samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REWARD_MODEL_LOSSES = ("sigmoid", "logexp")


def reward_model_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, *, kind: str = "sigmoid",
                      margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """Pairwise reward-model loss, mean over pairs. chosen_scores, rejected_scores (B,); margin (B,) or a number.

    ``sigmoid``: −log σ(r_c − r_r − margin); ``logexp``: log(1 + exp(r_r − r_c)) (no margin, as OpenRLHF).
    """
    import torch.nn.functional as F

    if kind == "sigmoid":
        gap = chosen_scores - rejected_scores if margin is None else chosen_scores - rejected_scores - margin  # (B,)
        return -F.logsigmoid(gap).mean()
    if kind == "logexp":
        return F.softplus(rejected_scores - chosen_scores).mean()  # log(1 + exp(x)), without overflow
    raise ValueError(f"reward model loss kind must be one of {', '.join(REWARD_MODEL_LOSSES)}, got {kind!r}")


def dpo_loss(policy_chosen_logprobs: torch.Tensor, policy_rejected_logprobs: torch.Tensor,
             ref_chosen_logprobs: torch.Tensor, ref_rejected_logprobs: torch.Tensor, *, beta: float = 0.1,
             label_smoothing: float = 0.0, ipo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO / cDPO / IPO, mean over pairs; and the implicit rewards β(log π − log π_ref), detached.

    All inputs (B,): summed log-probs of each response. Returns ``(loss (), chosen_rewards (B,),
    rejected_rewards (B,))``.
    """
    import torch.nn.functional as F

    logits = ((policy_chosen_logprobs - policy_rejected_logprobs)
              - (ref_chosen_logprobs - ref_rejected_logprobs))  # (B,)
    if ipo:
        losses = (logits - 1 / (2 * beta)) ** 2  # (B,)
    else:
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)  # (B,)
    chosen_rewards = beta * (policy_chosen_logprobs - ref_chosen_logprobs).detach()  # (B,)
    rejected_rewards = beta * (policy_rejected_logprobs - ref_rejected_logprobs).detach()  # (B,)
    return losses.mean(), chosen_rewards, rejected_rewards


def kto_loss(policy_chosen_logprobs: torch.Tensor, policy_rejected_logprobs: torch.Tensor,
             policy_kl_logprobs: torch.Tensor, ref_chosen_logprobs: torch.Tensor, ref_rejected_logprobs: torch.Tensor,
             ref_kl_logprobs: torch.Tensor, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO, mean over desirable and undesirable samples together; either side may be empty.

    *_chosen_logprobs (D,) desirable samples, *_rejected_logprobs (U,) undesirable ones,
    *_kl_logprobs (K,) the mismatched (prompt, other completion) pairs that estimate the reference
    point z (detached, clamped at 0). Returns ``(loss (), chosen_rewards (D,), rejected_rewards (U,), z ())``.
    """
    import torch

    kl = (policy_kl_logprobs - ref_kl_logprobs).mean().detach().clamp(min=0)  # ()
    chosen_logratios = policy_chosen_logprobs - ref_chosen_logprobs  # (D,)
    rejected_logratios = policy_rejected_logprobs - ref_rejected_logprobs  # (U,)
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))  # (D,)
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))  # (U,)
    loss = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0).mean()
    return loss, beta * chosen_logratios.detach(), beta * rejected_logratios.detach(), kl
