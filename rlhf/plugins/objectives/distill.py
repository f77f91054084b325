"""``distill``: knowledge distillation from a teacher (``--teacher``) into the trained student.

loss = (1 − kd) · SFT + kd · KD over the learnt (response) tokens: SFT is the next-token NLL
(``rlhf.objectives.sft_loss``), KD the cross-entropy of the student's next-token distribution
to the teacher's, −Σ_v p_teacher(v) log p_student(v) (forward KL up to the teacher's entropy;
``rlhf.objectives.distillation_loss``, OpenRLHF's ``KDLoss``, after MiniLLM), both means over
the same tokens; one unit per learnt token. Teacher and student share the tokenizer.

Deviation: OpenRLHF's trainer masks the KD term with the unshifted labels (the predictions made
at response tokens, i.e. of the token after each); here both terms score the predictions of the
response tokens themselves (positions shifted by one, as the SFT term is).
With vocab chunks (the default) both terms come from the two models' hidden states, the
vocabulary a few positions at a time (`rlhf.fastpaths.vocab_chunks`). Metrics: ``sft_loss``, ``kd_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf.api import ConfigError, FitModels, ObjectiveBase, TextFormat, distillation_loss, sft_loss, token_batch
from rlhf.plugins.objectives.config import DistillConfig
from rlhf.plugins.objectives.sft import response_example

IGNORE_INDEX = -100


class DistillObjective(ObjectiveBase):
    """Distillation: the student matches the teacher's next-token distribution, plus the SFT loss."""

    config: DistillConfig

    def __init__(self, config: DistillConfig | None = None):
        super().__init__(config or DistillConfig())

    def columns(self) -> list[str]:
        return [self.config.input_key] + ([self.config.output_key] if self.config.output_key else [])

    def encode(self, row: Mapping[str, Any], text: TextFormat) -> tuple[list[int], list[int]]:
        return response_example(row, self.config.input_key, self.config.output_key, text)

    def collate(self, examples: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, Any]:
        return token_batch(examples, pad_token_id)

    def units(self, batch: dict[str, Any]) -> float:
        return float(batch["loss_mask"][:, 1:].sum())

    def loss(self, models: FitModels, batch: dict[str, Any], stats: Mapping[str, float]) -> tuple[Any, dict[str, Any]]:
        from rlhf.api import deferred_head

        student, teacher = deferred_head(models.model), deferred_head(models.teacher)
        if student is not None and teacher is not None:
            sft, kd = self._chunked_terms(models, batch, student, teacher)
        else:
            sft, kd = self._terms(models, batch)
        coef = self.config.kd_coef
        loss = (1 - coef) * sft + coef * kd
        return loss, {"sft_loss": float(sft.detach()), "kd_loss": float(kd.detach())}

    def _terms(self, models: FitModels, batch: dict[str, Any]) -> tuple[Any, Any]:
        """(SFT, KD) from both models' full logits."""
        import torch

        input_ids, attention_mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        logits = models.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
        with torch.no_grad():
            teacher_logits = models.teacher(input_ids=input_ids, attention_mask=attention_mask,
                                            use_cache=False).logits  # (B, T, V)
        if teacher_logits.shape != logits.shape:
            raise ConfigError(f"the teacher's logits have shape {tuple(teacher_logits.shape)}, the student's "
                              f"{tuple(logits.shape)}: distillation needs the same tokenizer and vocabulary")
        labels = torch.where(loss_mask.bool(), input_ids, IGNORE_INDEX)  # (B, T): learnt tokens, -100 elsewhere
        sft = sft_loss(logits, labels)
        # position t predicts token t + 1: distill the predictions of the learnt tokens
        kd = distillation_loss(logits[:, :-1], teacher_logits[:, :-1], loss_mask[:, 1:])
        return sft, kd

    def _chunked_terms(self, models: FitModels, batch: dict[str, Any], student: Any,
                       teacher: Any) -> tuple[Any, Any]:
        """(SFT, KD) from both models' hidden states, the vocabulary a tile at a time
        (`rlhf.core.logprobs.DeferredHead`): only the learnt tokens' predictions are projected."""
        import torch

        from rlhf.api import hidden_states_out

        input_ids, attention_mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        if student.weight.shape[0] != teacher.weight.shape[0]:
            raise ConfigError(f"the teacher's vocabulary has {teacher.weight.shape[0]} tokens, the student's "
                              f"{student.weight.shape[0]}: distillation needs the same tokenizer and vocabulary")
        with hidden_states_out(student):
            hidden = models.model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).logits  # (B, T, H)
        with torch.no_grad(), hidden_states_out(teacher):
            teacher_hidden = models.teacher(input_ids=input_ids, attention_mask=attention_mask,
                                            use_cache=False).logits  # (B, T, H')
        # position t predicts token t + 1: the predictions of the learnt tokens
        learnt = loss_mask[:, 1:].bool()  # (B, T-1)
        targets = input_ids[:, 1:][learnt]  # (K,)
        logprobs, _ = student.position_logprobs(hidden[:, :-1][learnt], targets)  # (K,)
        sft = -logprobs.mean()
        kd = student.cross_entropy_to(hidden[:, :-1][learnt], teacher, teacher_hidden[:, :-1][learnt]).mean()
        return sft, kd
