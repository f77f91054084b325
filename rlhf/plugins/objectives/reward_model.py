"""``rm``: a reward model trained on preference pairs (Bradley-Terry; Ouyang et al. 2022).

score(x) = the scalar head's value at the last token of prompt + response + EOS (EOS appended as
OpenRLHF does, so the score is read at the same token in training and in ``rlhf train
--reward DIR``). loss = −log σ(r_c − r_r − margin) (``sigmoid``, optional per-pair margin column)
or log(1 + exp(r_r − r_c)) (``logexp``), mean over pairs (``rlhf.objectives.reward_model_loss``);
one unit per pair. Metrics: ``accuracy`` (share of pairs with r_c > r_r), ``margin`` (mean
r_c − r_r), ``chosen_score``, ``rejected_score``.

The saved model's config.json records ``reward_append_eos: true`` and, with
``--normalize-reward``, ``normalize_reward: true`` with the ``mean`` and ``std`` (unbiased) of
its scores over every chosen and rejected text of the training set, computed after training;
``rlhf train --reward DIR`` then scores (r − mean) / std (OpenRLHF computes them on the eval set).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rlhf.api import BadRow, FitModels, ObjectiveBase, TextFormat, last_token_scores, reward_model_loss, token_batch
from rlhf.plugins.objectives.config import RewardModelConfig
from rlhf.plugins.objectives.pairs import pair_columns, pair_texts


class RewardModelObjective(ObjectiveBase):
    """Reward model on preference pairs: pairwise sigmoid (with margins) or logexp loss."""

    config: RewardModelConfig

    def __init__(self, config: RewardModelConfig | None = None):
        super().__init__(config or RewardModelConfig())

    def columns(self) -> list[str]:
        return pair_columns(self.config) + ([self.config.margin_key] if self.config.margin_key else [])

    def encode(self, row: Mapping[str, Any], text: TextFormat) -> tuple[list[int], list[int], float]:
        prompt_text, chosen_text, rejected_text = pair_texts(row, self.config, text)
        chosen, _ = text.join([], text.ids(prompt_text + chosen_text))
        rejected, _ = text.join([], text.ids(prompt_text + rejected_text))
        margin = 0.0
        if self.config.margin_key:
            try:
                margin = float(row[self.config.margin_key])
            except (TypeError, ValueError):
                raise BadRow(f"{self.config.margin_key!r} must be a number, got {row[self.config.margin_key]!r}") from None
        return chosen, rejected, margin

    def collate(self, examples: list[tuple[list[int], list[int], float]], pad_token_id: int) -> dict[str, Any]:
        import torch

        sequences = [(c, [1] * len(c)) for c, _, _ in examples] + [(r, [1] * len(r)) for _, r, _ in examples]
        batch = token_batch(sequences, pad_token_id)  # rows: chosen 0..P-1, then rejected P..2P-1
        batch["margin"] = torch.tensor([m for _, _, m in examples], dtype=torch.float32)  # (P,)
        return batch

    def units(self, batch: dict[str, Any]) -> float:
        return float(len(batch["margin"]))

    def scores(self, models: FitModels, batch: dict[str, Any]) -> tuple[Any, Any]:
        scores = last_token_scores(models.model, batch["input_ids"], batch["attention_mask"])  # (2P,)
        pairs = len(batch["margin"])
        return scores[:pairs], scores[pairs:]  # (P,), (P,)

    def loss(self, models: FitModels, batch: dict[str, Any], stats: Mapping[str, float]) -> tuple[Any, dict[str, Any]]:
        chosen, rejected = self.scores(models, batch)
        margin = batch["margin"] if self.config.margin_key else None
        loss = reward_model_loss(chosen, rejected, kind=self.config.loss, margin=margin)
        gap = (chosen - rejected).detach()  # (P,)
        return loss, {"accuracy": float((gap > 0).float().mean()), "margin": float(gap.mean()),
                      "chosen_score": float(chosen.detach().mean()), "rejected_score": float(rejected.detach().mean())}

    def final_statistics(self, models: FitModels, batch: dict[str, Any]) -> dict[str, float] | None:
        if not self.config.normalize_reward:
            return None
        scores = last_token_scores(models.model, batch["input_ids"], batch["attention_mask"]).double()  # (2P,)
        return {"count": float(len(scores)), "sum": float(scores.sum()), "sum_sq": float((scores ** 2).sum())}

    def output_config(self, stats: Mapping[str, float]) -> dict[str, Any]:
        out: dict[str, Any] = {"reward_append_eos": True, "normalize_reward": False}
        if self.config.normalize_reward:
            count = stats["count"]
            mean = stats["sum"] / count
            variance = (stats["sum_sq"] - count * mean ** 2) / max(count - 1, 1)
            out.update(normalize_reward=True, mean=mean, std=max(math.sqrt(max(variance, 0.0)), 1e-8))
        return out
