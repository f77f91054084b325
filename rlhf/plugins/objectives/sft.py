"""``sft``: supervised fine-tuning, the next-token loss on the response tokens.

loss = −Σ_t m_t log π(x_{t+1} | x_≤t) / Σ_t m_t over the micro-batch's learnt tokens (m: 1 on
response tokens and the EOS appended after them; with ``--multiturn`` on every assistant turn;
with ``--pretrain-mode`` on every token). One unit per learnt token, so an optimizer step's loss
is the mean over every learnt token of the step (``rlhf.objectives.sft_loss``, OpenRLHF's
``GPTLMLoss``). Eval metric: ``loss``, the mean NLL per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf.api import BadRow, FitModels, ObjectiveBase, TextFormat, learnt_logprobs, require, response_mask, token_batch
from rlhf.plugins.objectives.config import SFTConfig


class SFTObjective(ObjectiveBase):
    """Supervised fine-tuning: next-token loss on the responses (or every assistant turn, or every token)."""

    config: SFTConfig

    def __init__(self, config: SFTConfig | None = None):
        super().__init__(config or SFTConfig())

    def columns(self) -> list[str]:
        keys = [self.config.input_key]
        if self.config.output_key and not self.config.pretrain_mode:
            keys.append(self.config.output_key)
        return keys

    def encode(self, row: Mapping[str, Any], text: TextFormat) -> tuple[list[int], list[int]]:
        config = self.config
        value = require(row, config.input_key)
        if config.pretrain_mode:
            if not isinstance(value, str):
                raise BadRow(f"{config.input_key!r} must be a string with --pretrain-mode")
            ids = text.ids(value)[:text.max_len]
            return ids, [1] * len(ids)
        if config.multiturn:
            return multiturn_example(value, row.get(config.output_key) if config.output_key else None, text)
        return response_example(row, config.input_key, config.output_key, text)

    def collate(self, examples: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, Any]:
        return token_batch(examples, pad_token_id)

    def units(self, batch: dict[str, Any]) -> float:
        return float(batch["loss_mask"][:, 1:].sum())

    def loss(self, models: FitModels, batch: dict[str, Any], stats: Mapping[str, float]) -> tuple[Any, dict[str, Any]]:
        logprobs = learnt_logprobs(models.model, batch["input_ids"], batch["attention_mask"],
                                   batch["loss_mask"])  # (B, A)
        tokens = batch["loss_mask"][:, 1:].sum()
        loss = -logprobs.sum() / tokens.clamp(min=1)
        return loss, {}


def multiturn_example(messages: Any, last: Any, text: TextFormat) -> tuple[list[int], list[int]]:
    """A conversation with every assistant turn learnt: token spans found by tokenizing the template of
    each prefix (the template's role markers keep the boundaries stable). Each turn's span ends with
    what the template puts after it; the text ends at its last real token (trailing newlines
    dropped), then EOS, so the last turn is encoded as `response_example` encodes it."""
    if not isinstance(messages, list):
        raise BadRow("--multiturn needs a conversation (a list of messages)")
    messages = list(messages) + ([last] if isinstance(last, dict) else list(last) if isinstance(last, list) else [])
    ids = text.ids(text.chat(messages).rstrip("\n"))  # EOS follows the last real token, as in `TextFormat.response`
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        start = len(text.ids(text.chat(messages[:index], generation_prompt=True))) if index else 0
        end = len(text.ids(text.chat(messages[:index + 1])))
        for position in range(start, min(end, len(ids))):
            mask[position] = 1
    if not any(mask):
        raise BadRow("the conversation has no assistant message to learn")
    ids.append(text.eos_token_id)
    mask.append(1 if messages[-1].get("role") == "assistant" else 0)
    if len(ids) > text.max_len:
        ids, mask = ids[:text.max_len], mask[:text.max_len]
        ids[-1] = text.eos_token_id
    return ids, mask


def response_example(row: Mapping[str, Any], input_key: str, output_key: str | None,
                     text: TextFormat) -> tuple[list[int], list[int]]:
    """``(ids, loss mask)``: prompt + response + EOS, the response learnt. Without ``output_key`` the
    ``input_key`` column is a conversation whose last message is the response."""
    value = require(row, input_key)
    if output_key:
        prompt_text, response_text = text.prompt(value), text.response(value, require(row, output_key))
    else:
        prompt_text, response_text = text.conversation(value)
    ids, prompt_len = text.join(text.prompt_ids(prompt_text), text.ids(response_text))
    return ids, response_mask(len(ids), prompt_len)
