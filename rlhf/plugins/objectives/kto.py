"""``kto``: Kahneman-Tversky Optimization on unpaired desirable / undesirable completions
(Ethayarajh et al. 2024), against a frozen reference.

With r = log π(y|x) − log π_ref(y|x) over a completion's tokens (EOS included) and the reference
point z = max(0, mean over mismatched pairs (x_i, y_{i+1}) of log π − log π_ref), detached:
desirable loss w_d (1 − σ(β(r − z))), undesirable w_u (1 − σ(β(z − r))), mean over the samples
(``rlhf.objectives.kto_loss``, OpenRLHF's ``KTOLoss``); one unit per sample.

Each sample is paired with the completion of the next sample of its optimizer step (the step's
order, before it is split over ranks and micro-batches), and z is the mean over the whole step,
computed before the step's loss (a ``step_statistics`` pass), so it does not depend on the
micro-batch size or the number of ranks. Deviation: OpenRLHF pairs within each micro-batch and
averages z over the ranks' micro-batches.

Metrics: ``accuracy`` (share of samples on the right side of the reference point: r > z when
desirable, r < z when undesirable), ``chosen_reward`` / ``rejected_reward`` (mean βr over the
desirable / undesirable samples), ``kl`` (z).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlhf.api import (BadRow, FitModels, ObjectiveBase, TextFormat, kto_loss, learnt_logprobs, require, response_mask,
                      sequence_logprobs, token_batch)
from rlhf.plugins.objectives.config import KTOConfig

_TRUE = ("true", "1", "yes", "desirable", "good")
_FALSE = ("false", "0", "no", "undesirable", "bad")


@dataclasses.dataclass
class KTOExample:
    prompt_ids: list[int]
    ids: list[int]  # prompt + completion + EOS
    prompt_len: int
    desirable: bool
    kl_ids: list[int] | None = None  # prompt + the next sample's completion (set per step)


class KTOObjective(ObjectiveBase):
    """KTO on unpaired desirable / undesirable completions, reference point from mismatched pairs."""

    config: KTOConfig
    # rows for `rlhf plugins check kto` (default column names)
    sample_rows = [{"prompt": "What is 2 + 3?", "completion": "The answer is 5.", "label": True},
                   {"prompt": "Say hello.", "completion": "goodbye", "label": False},
                   {"prompt": "What is 6 + 1?", "completion": "It is 7.", "label": True},
                   {"prompt": "Name a colour.", "completion": "a dog", "label": False}]

    def __init__(self, config: KTOConfig | None = None):
        super().__init__(config or KTOConfig())

    def columns(self) -> list[str]:
        return [self.config.prompt_key, self.config.output_key, self.config.label_key]

    def encode(self, row: Mapping[str, Any], text: TextFormat) -> KTOExample:
        config = self.config
        prompt = require(row, config.prompt_key)
        prompt_ids = text.prompt_ids(text.prompt(prompt))
        ids, prompt_len = text.join(prompt_ids, text.ids(text.response(prompt, require(row, config.output_key))))
        return KTOExample(prompt_ids=prompt_ids, ids=ids, prompt_len=prompt_len,
                          desirable=_label(row.get(config.label_key), config.label_key))

    def step_examples(self, examples: list[KTOExample]) -> list[KTOExample]:
        paired = []
        for index, example in enumerate(examples):
            other = examples[(index + 1) % len(examples)]
            completion = other.ids[other.prompt_len:]
            # within the longer of the two sequences, so within --max-len
            kl_ids = (example.prompt_ids + completion)[:max(len(example.ids), len(other.ids))]
            paired.append(dataclasses.replace(example, kl_ids=kl_ids))
        return paired

    def collate(self, examples: list[KTOExample], pad_token_id: int) -> dict[str, Any]:
        import torch

        batch = token_batch([(e.ids, response_mask(len(e.ids), e.prompt_len)) for e in examples], pad_token_id)
        batch["desirable"] = torch.tensor([e.desirable for e in examples])  # (B,)
        if all(e.kl_ids is not None for e in examples):
            kl = token_batch([(e.kl_ids, response_mask(len(e.kl_ids), len(e.prompt_ids))) for e in examples],
                             pad_token_id)
            batch.update({f"kl_{key}": value for key, value in kl.items()})
        return batch

    def units(self, batch: dict[str, Any]) -> float:
        return float(len(batch["desirable"]))

    def step_statistics(self, models: FitModels, batch: dict[str, Any]) -> dict[str, float]:
        inputs = (batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_loss_mask"])
        mask = batch["kl_loss_mask"][:, 1:]  # (B, A)
        policy, _ = sequence_logprobs(learnt_logprobs(models.model, *inputs), mask)  # (B,)
        reference, _ = sequence_logprobs(learnt_logprobs(models.reference, *inputs), mask)  # (B,)
        return {"kl_sum": float((policy - reference).sum()), "kl_count": float(len(policy))}

    def loss(self, models: FitModels, batch: dict[str, Any], stats: Mapping[str, float]) -> tuple[Any, dict[str, Any]]:
        import torch

        inputs = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        mask = batch["loss_mask"][:, 1:]  # (B, A)
        policy, _ = sequence_logprobs(learnt_logprobs(models.model, *inputs), mask)  # (B,)
        with torch.no_grad():
            reference, _ = sequence_logprobs(learnt_logprobs(models.reference, *inputs), mask)  # (B,)
        z = torch.tensor([stats["kl_sum"] / stats["kl_count"]], dtype=policy.dtype, device=policy.device)  # (1,)
        desirable = batch["desirable"].bool()  # (B,)
        config = self.config
        loss, chosen_rewards, rejected_rewards, kl = kto_loss(
            policy[desirable], policy[~desirable], z, reference[desirable], reference[~desirable], torch.zeros_like(z),
            beta=config.beta, desirable_weight=config.desirable_weight, undesirable_weight=config.undesirable_weight)
        logratio = (policy - reference).detach()  # (B,)
        right_side = torch.where(desirable, logratio > kl, logratio < kl)  # (B,)
        metrics: dict[str, Any] = {"accuracy": float(right_side.float().mean()), "kl": float(kl)}
        if len(chosen_rewards):
            metrics["chosen_reward"] = (float(chosen_rewards.mean()), float(len(chosen_rewards)))
        if len(rejected_rewards):
            metrics["rejected_reward"] = (float(rejected_rewards.mean()), float(len(rejected_rewards)))
        return loss, metrics


def _label(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise BadRow(f"{key!r} must be true/false (or 1/0) saying whether the completion is desirable; got {value!r}")
