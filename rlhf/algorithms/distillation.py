"""On-policy distillation (``--teacher``, ``--algo opd``): the teacher's score of every sampled token
as a per-token advantage.

The student samples (as in GRPO); a frozen teacher scores the sampled tokens with one forward;
the per-token reverse KL estimate of the sampled token

    rkl_t = log π_S(y_t | y_<t) − log π_T(y_t | y_<t)

is the negative reward of token t, with no baseline and no discount (each token is credited with its
own term only), added to the run's task advantages:

    Â_t = Â^task_t − λ · m_t · rkl_t        λ = --teacher-coef (default 1), m = the loss mask

``--algo opd`` is the GRPO estimator with no KL term: with no reward source every task advantage
is 0 and the update is pure distillation; with ``--reward`` the task rewards' group-normalised
advantages and the teacher's term add up, λ weighing the teacher. Maximising the surrogate
Σ_t Â_t · ratio_t descends E_{y∼π_S}[Σ_t rkl_t] = KL(π_S ‖ π_T) over whole completions (reverse KL,
mode seeking): the sampled-token estimate is unbiased for the per-token reverse KL and needs only
the sampled token's log-prob from each model, never a full-vocabulary distribution (the
log-probs come through `rlhf.core.logprobs.token_logprobs`, vocabulary chunks included).

References: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD, arXiv:2306.13649); Lu & Thinking Machines Lab 2025, "On-Policy
Distillation" (the per-token reverse KL as a discount-0 advantage: tinker-cookbook's
``distillation/train_on_policy.py`` ``incorporate_kl_penalty``, coefficient ``kl_penalty_coef``,
added to the task advantages); slime's ``--use-opd`` (``Â_t = A_t − λ_opd · rkl_t`` on top of any
estimator). Our λ is their ``kl_penalty_coef`` / ``opd_kl_coef``.

Deviations: the student log-prob is the behaviour policy's as this framework computes it (the old
log-probs: recomputed by the trainer, or ``--async``'s behaviour policy's), not the inference
engine's report; both models score at the sampling temperature τ (log softmax(z/τ), as the
reference does), which is tinker's at τ = 1; the policy loss is the run's (PPO's clipped ratio by
default, identical to tinker's importance-sampling loss with one optimizer step per rollout);
tinker's optional ``kl_discount_factor`` (> 0: discounted sums of future terms) is not offered.
TRL's GKDTrainer distils with a full-vocabulary generalised JSD in the loss instead, which holds
(B, A, V) logits; this is its β = 1 (reverse KL) case estimated on the sampled tokens.

Shape legend: ``B`` sequences, ``A`` action positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, A) rkl_t = m_t · (log π_S − log π_T) of the sampled tokens, 0 off the mask."""
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != mask.shape:
        raise ValueError(f"student log-probs {tuple(student_logprobs.shape)}, teacher log-probs "
                         f"{tuple(teacher_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape (B, A)")
    return (student_logprobs.float() - teacher_logprobs.float()) * mask.float()  # (B, A)


def teacher_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       coef: float = 1.0) -> torch.Tensor:
    """(B, A) the teacher's per-token advantages −λ · m_t · rkl_t (no baseline, no discount), to add
    to the task advantages."""
    if not coef > 0:
        raise ValueError(f"the teacher coefficient λ must be positive, got {coef}")
    return -coef * reverse_kl(student_logprobs, teacher_logprobs, mask)  # (B, A)
