"""``dpo``: Direct Preference Optimization and its variants, against a frozen reference.

With h = (log π(y_c) − log π(y_r)) − (log π_ref(y_c) − log π_ref(y_r)) over the summed log-probs
of each response's tokens (EOS included): DPO −log σ(βh) (Rafailov et al. 2023); cDPO with label
smoothing ε, −(1 − ε) log σ(βh) − ε log σ(−βh); IPO (h − 1/(2β))² (Azar et al. 2023)
(``rlhf.objectives.dpo_loss``, OpenRLHF's ``DPOLoss``). ``--nll-coef c`` adds c × the chosen
responses' NLL (per-token mean, averaged over pairs, as OpenRLHF). Mean over pairs; one unit
per pair. The reference is the starting model (with LoRA: the same weights, adapter off).
Chosen and rejected share their prompt's forward (``--share-prompt``, on by default:
`rlhf.fastpaths.prefix_sharing`): one row per pair, prompt + chosen + rejected, each response
attending to the prompt and itself; with ``--packing`` those rows' real tokens run as one row. The log-probs are the separate forwards' up to float
rounding; each model's first micro-batch checks that against separate forwards and falls back
to them, with a warning, for a model that does not take the mask.
Metrics: ``accuracy`` (share of pairs whose implicit reward β(log π − log π_ref) is higher for
the chosen), ``margin`` (mean reward gap), ``chosen_reward``, ``rejected_reward``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf.api import (FitModels, ObjectiveBase, TextFormat, dpo_loss, learnt_logprobs, response_mask, sequence_logprobs,
                      shared_learnt_logprobs, token_batch)
from rlhf.plugins.objectives.config import DPOConfig
from rlhf.plugins.objectives.pairs import pair_columns, pair_texts


class DPOObjective(ObjectiveBase):
    """DPO on preference pairs against a frozen reference; IPO, cDPO label smoothing, NLL term."""

    config: DPOConfig

    def __init__(self, config: DPOConfig | None = None):
        super().__init__(config or DPOConfig())

    def columns(self) -> list[str]:
        return pair_columns(self.config)

    def encode(self, row: Mapping[str, Any], text: TextFormat) -> tuple[tuple[list[int], list[int]], ...]:
        prompt_text, chosen_text, rejected_text = pair_texts(row, self.config, text)
        prompt_ids = text.prompt_ids(prompt_text) if prompt_text else []
        pair = []
        for response_text in (chosen_text, rejected_text):
            ids, prompt_len = text.join(prompt_ids, text.ids(response_text))
            pair.append((ids, response_mask(len(ids), prompt_len)))
        return tuple(pair)

    def collate(self, examples: list[tuple[tuple[list[int], list[int]], ...]], pad_token_id: int) -> dict[str, Any]:
        # rows: chosen 0..P-1, then rejected P..2P-1 (one forward for both)
        return token_batch([chosen for chosen, _ in examples] + [rejected for _, rejected in examples], pad_token_id)

    def units(self, batch: dict[str, Any]) -> float:
        return len(batch["input_ids"]) / 2

    def loss(self, models: FitModels, batch: dict[str, Any], stats: Mapping[str, float]) -> tuple[Any, dict[str, Any]]:
        import torch

        pairs = len(batch["input_ids"]) // 2
        mask = batch["loss_mask"][:, 1:]  # (2P, A)
        forward = self._forward(batch, models.share_prompt)
        sums, means = sequence_logprobs(forward(models.model), mask)  # (2P,), (2P,)
        with torch.no_grad():
            ref_sums, _ = sequence_logprobs(forward(models.reference), mask)  # (2P,)
        config = self.config
        loss, chosen_rewards, rejected_rewards = dpo_loss(sums[:pairs], sums[pairs:], ref_sums[:pairs],
                                                          ref_sums[pairs:], beta=config.beta,
                                                          label_smoothing=config.label_smoothing, ipo=config.ipo)
        metrics = preference_metrics(chosen_rewards, rejected_rewards)
        if config.nll_coef > 0:
            nll = -means[:pairs].mean()
            loss = loss + config.nll_coef * nll
            metrics["nll"] = float(nll.detach())
        return loss, metrics

    def _forward(self, batch: dict[str, Any], share: bool) -> Any:
        """``m -> (2P, A) log-probs of the learnt tokens under m`` (the policy or the reference), each
        pair's prompt shared when ``share`` and the model takes it (`checked_for_sharing`)."""
        from rlhf.api import can_share, checked_for_sharing, share_prefixes, without_last_token

        inputs = (batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        pairs = len(batch["input_ids"]) // 2
        rows = share_prefixes(batch["input_ids"], without_last_token(batch["attention_mask"]),
                              [(i, pairs + i) for i in range(pairs)]) if share else None

        def forward(m: Any) -> Any:
            def shared() -> Any:
                return shared_learnt_logprobs(m, rows, batch["input_ids"], batch["loss_mask"])

            def separate() -> Any:
                return learnt_logprobs(m, *inputs)

            if rows is not None and can_share(m) and \
                    checked_for_sharing(m, rows, shared, separate, "dpo"):
                return shared()
            return separate()

        return forward


def preference_metrics(chosen_rewards: Any, rejected_rewards: Any) -> dict[str, float]:
    """Accuracy, margin and mean rewards of implicit rewards (P,) of chosen and rejected responses."""
    gap = chosen_rewards - rejected_rewards  # (P,)
    return {"accuracy": float((gap > 0).float().mean()), "margin": float(gap.mean()),
            "chosen_reward": float(chosen_rewards.mean()), "rejected_reward": float(rejected_rewards.mean())}
