"""The math of the offline objectives as plain functions (docs/objectives.md), for the objective plugins,
notebooks and tests. Each equals OpenRLHF's loss class of the same purpose on the same inputs:

===========================  =================================================================
``sft_loss``                  ``GPTLMLoss``: next-token cross-entropy, mean over labelled tokens
``reward_model_loss``         ``PairWiseLoss`` (sigmoid, optional margin) / ``LogExpLoss``
``dpo_loss``                  ``DPOLoss``: DPO, cDPO (label smoothing), IPO
``kto_loss``                  ``KTOLoss`` (uneven sampling, one process)
``distillation_loss``         ``KDLoss``: token-level forward KL to a teacher, as cross-entropy
``prm_loss``                  ``PRMLoss``: cross-entropy at placeholder tokens, hard or soft labels
===========================  =================================================================

Each returns the mean over its batch, as OpenRLHF's do; the fit loop turns a micro-batch's mean
into its share of the optimizer step (mean × micro-batch count / step count), so a step's gradient
does not depend on how it is split.

Helpers for objective writers (``batching``): `pad_right`, `token_batch`, `response_mask`,
`learnt_logprobs` (log-probs of the learnt tokens), `shared_learnt_logprobs` (the same, rows
sharing their prompt's forward) and `last_token_scores` (a scalar head's score).

Shape legend: ``B`` sequences (or pairs), ``T`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from rlhf.objectives.batching import (last_token_scores, learnt_logprobs, pad_right, response_mask,
                                     shared_learnt_logprobs, token_batch)
from rlhf.objectives.language import distillation_loss, sequence_logprobs, sft_loss
from rlhf.objectives.preference import dpo_loss, kto_loss, reward_model_loss
from rlhf.objectives.process import prm_loss, prm_loss_at

__all__ = ["distillation_loss", "dpo_loss", "kto_loss", "last_token_scores", "learnt_logprobs", "pad_right",
           "prm_loss", "prm_loss_at", "response_mask", "reward_model_loss", "sequence_logprobs", "sft_loss",
           "shared_learnt_logprobs", "token_batch"]
