"""``prm``: a process reward model, a causal LM that labels each step of a solution at a
placeholder token (Math-Shepherd, Wang et al. 2023).

The input holds a placeholder token (``--placeholder-token``, e.g. ``ки``) after every step; the
label column holds one label per placeholder: a reward token (``+`` / ``-``: hard labels) or the
probability of the first reward token (soft labels, needs two ``--reward-tokens``). At each
placeholder the model's logits (restricted to the reward tokens when given) are trained with
cross-entropy to the label (``rlhf.objectives.prm_loss``, OpenRLHF's ``PRMLoss``; with vocab
chunks only the placeholder positions are projected to the vocabulary); mean over the
placeholders, one unit per placeholder. Metric: ``accuracy``, the share of steps whose most
likely reward token is the label. Texts are tokenized without special tokens; placeholders cut
off by ``--max-len`` lose their labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf.api import (BadRow, ConfigError, FitModels, ObjectiveBase, SkipExample, TextFormat, pad_right, prm_loss,
                      prm_loss_at, require)
from rlhf.plugins.objectives.config import PRMConfig

IGNORE_INDEX = -100


class PRMObjective(ObjectiveBase):
    """Process reward model: labels at placeholder tokens after each step, hard (+/-) or soft."""

    config: PRMConfig
    # for `rlhf plugins check prm`: a placeholder that is one token of the check's tiny tokenizer
    sample_settings = {"placeholder_token": "<|im_end|>", "reward_tokens": ["+", "-"]}
    sample_rows = [{"input": "Add 2 and 3.<|im_end|> The sum is 5.<|im_end|>", "label": ["+", "+"]},
                   {"input": "Add 6 and 1.<|im_end|> The sum is 8.<|im_end|>", "label": ["+", "-"]},
                   {"input": "Double 4.<|im_end|>", "label": ["-"]},
                   {"input": "Halve 10.<|im_end|> It is 5.<|im_end|>", "label": ["+", "+"]}]

    def __init__(self, config: PRMConfig | None = None):
        super().__init__(config or PRMConfig())
        self._tokens: tuple[int, list[int] | None] | None = None

    def columns(self) -> list[str]:
        return [self.config.input_key, self.config.label_key]

    def token_ids(self, text: TextFormat) -> tuple[int, list[int] | None]:
        """The placeholder's id and the reward tokens' ids (each must be one token)."""
        if self._tokens is None:
            reward = [single_token(text, t, "--reward-tokens") for t in self.config.reward_tokens or []] or None
            self._tokens = single_token(text, self.config.placeholder_token, "--placeholder-token"), reward
        return self._tokens

    def encode(self, row: Mapping[str, Any], text: TextFormat) -> tuple[list[int], list[float | int]]:
        config = self.config
        placeholder, reward_ids = self.token_ids(text)
        value, labels = require(row, config.input_key), require(row, config.label_key)
        if not isinstance(value, str):
            raise BadRow(f"{config.input_key!r} must be a string")
        if not isinstance(labels, list):
            raise BadRow(f"{config.label_key!r} must be a list with one label per placeholder")
        ids = text.ids(value)
        count = ids.count(placeholder)
        if len(labels) != count:
            raise BadRow(f"{len(labels)} labels for {count} placeholder tokens {config.placeholder_token!r}")
        ids = ids[:text.max_len]
        labels = labels[:ids.count(placeholder)]
        if not labels:
            raise SkipExample(f"no placeholder token {config.placeholder_token!r} within --max-len")
        if all(isinstance(label, str) for label in labels):
            step_labels: list[float | int] = [self._hard(label, text, reward_ids) for label in labels]
        elif all(isinstance(label, (int, float)) and not isinstance(label, bool) for label in labels):
            if reward_ids is None or len(reward_ids) != 2:
                raise BadRow("probability labels need exactly two --reward-tokens (the first is the label's)")
            step_labels = [float(label) for label in labels]
        else:
            raise BadRow(f"{config.label_key!r} must hold reward tokens (strings) or probabilities (numbers)")
        per_token: list[float | int] = [IGNORE_INDEX] * len(ids)
        positions = [index for index, token in enumerate(ids) if token == placeholder]
        for position, label in zip(positions, step_labels):
            per_token[position] = label
        return ids, per_token

    def _hard(self, label: str, text: TextFormat, reward_ids: list[int] | None) -> int:
        if reward_ids is not None and label not in (self.config.reward_tokens or []):
            raise BadRow(f"label {label!r} is not one of --reward-tokens {' '.join(self.config.reward_tokens or [])}")
        return single_token(text, label, "a label", row_error=True)

    def collate(self, examples: list[tuple[list[int], list[float | int]]], pad_token_id: int) -> dict[str, Any]:
        import torch

        soft = any(isinstance(label, float) and label != IGNORE_INDEX for _, labels in examples for label in labels)
        width = max(len(ids) for ids, _ in examples)
        return {
            "input_ids": pad_right([ids for ids, _ in examples], pad_token_id, width=width),  # (B, T)
            "attention_mask": pad_right([[1] * len(ids) for ids, _ in examples], 0, width=width),  # (B, T)
            "labels": pad_right([labels for _, labels in examples], IGNORE_INDEX, width=width,
                                dtype=torch.float32 if soft else torch.long),  # (B, T)
        }

    def units(self, batch: dict[str, Any]) -> float:
        return float(((batch["input_ids"] == self._tokens[0]) & (batch["labels"] != IGNORE_INDEX)).sum())

    def loss(self, models: FitModels, batch: dict[str, Any], stats: Mapping[str, float]) -> tuple[Any, dict[str, Any]]:
        from rlhf.api import deferred_head, hidden_states_out

        placeholder, reward_ids = self._tokens
        head = deferred_head(models.model)
        with hidden_states_out(head):  # with a deferred output layer: (B, T, H) hidden states
            logits = models.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  use_cache=False).logits  # (B, T, V)
        if head is None:
            loss, accuracy = prm_loss(batch["input_ids"], logits, batch["labels"], placeholder_token_id=placeholder,
                                      reward_token_ids=reward_ids)
        else:  # only the placeholders are projected to the vocabulary
            at = batch["input_ids"] == placeholder  # (B, T)
            loss, accuracy = prm_loss_at(head(logits[at]), batch["labels"][at], reward_token_ids=reward_ids)
        return loss, {"accuracy": float(accuracy)}


def single_token(text: TextFormat, token: str, what: str, *, row_error: bool = False) -> int:
    ids = text.ids(token)
    if len(ids) != 1:
        message = (f"{what} {token!r} is {len(ids)} tokens for this tokenizer; it must be exactly one (choose a token "
                   "of the vocabulary, or add it to the tokenizer)")
        raise BadRow(message) if row_error else ConfigError(message)
    return ids[0]
