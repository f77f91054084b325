"""Reading a preference pair (prompt, chosen, rejected) from a row: shared by ``rm`` and ``dpo``.

Three layouts, as in OpenRLHF's preference data sets: a prompt column with string (or message)
responses; chosen and rejected as whole conversations sharing every message but the last (the
prompt is that shared part; needs ``--apply-chat-template``); or, without a prompt, two complete
texts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf.api import BadRow, SkipExample, TextFormat, require
from rlhf.plugins.objectives.config import PairConfig


def pair_columns(config: PairConfig) -> list[str]:
    return [key for key in (config.prompt_key, config.chosen_key, config.rejected_key) if key]


def pair_texts(row: Mapping[str, Any], config: PairConfig, text: TextFormat) -> tuple[str, str, str]:
    """``(prompt text, chosen response text, rejected response text)``; the prompt text may be ''."""
    chosen, rejected = require(row, config.chosen_key), require(row, config.rejected_key)
    prompt_key = config.prompt_key or ("prompt" if "prompt" in row else None)
    if prompt_key:
        prompt = require(row, prompt_key)
        texts = text.prompt(prompt), text.response(prompt, chosen), text.response(prompt, rejected)
    elif isinstance(chosen, str) and isinstance(rejected, str):
        texts = "", chosen.rstrip("\n"), rejected.rstrip("\n")
    else:
        prompt_text, chosen_text = text.conversation(chosen)
        rejected_prompt, rejected_text = text.conversation(rejected)
        if rejected_prompt != prompt_text:
            raise BadRow(f"{config.chosen_key!r} and {config.rejected_key!r} differ before their last message; a "
                         "pair must share its prompt")
        texts = prompt_text, chosen_text, rejected_text
    if texts[1] == texts[2]:
        raise SkipExample("chosen equals rejected")
    return texts
