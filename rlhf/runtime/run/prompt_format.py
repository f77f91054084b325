"""The prompt format a model was trained with, kept beside its weights (``prompt_format.json`` in
``final/`` and ``best/``), so the commands that use the model next format prompts the same way.

A model trained on plain prompts and then prompted through its tokenizer's chat template (or the
other way round) sees text it never saw in training and answers badly, silently. Every training
command records ``{"apply_chat_template": ..., "input_template": ...}`` when it exports a model;
``rlhf chat``, ``generate``, ``iterate``, ``train`` and the fit commands read it when
``--model`` is such a directory and neither ``--apply-chat-template`` nor ``--input-template``
was given (on the command line or in a ``--config`` file), and say so in one line. A flag given
explicitly wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError

FILE_NAME = "prompt_format.json"


@dataclass(frozen=True)
class PromptFormat:
    apply_chat_template: bool = False  # prompts went through the tokenizer's chat template
    input_template: str | None = None  # else: string prompts filled into this template ({} = the prompt)

    @classmethod
    def of(cls, config: Any) -> PromptFormat:
        """The format of a run's config (any config with ``apply_chat_template`` and ``input_template``)."""
        return cls(apply_chat_template=bool(config.apply_chat_template), input_template=config.input_template)

    def describe(self) -> str:
        if self.apply_chat_template:
            return "the tokenizer's chat template"
        if self.input_template:
            return f"the input template {self.input_template!r}"
        return "plain prompts (no chat template)"

    def write(self, directory: Path) -> None:
        (Path(directory) / FILE_NAME).write_text(json.dumps(
            {"apply_chat_template": self.apply_chat_template, "input_template": self.input_template}, indent=2) + "\n")

    @classmethod
    def read(cls, model: str | Path | None) -> PromptFormat | None:
        """The format recorded in the model directory ``model``; None when it records none (a hub
        name, a model not trained here)."""
        path = Path(model).expanduser() / FILE_NAME if model else None
        if path is None or not path.is_file():
            return None
        try:
            values = json.loads(path.read_text())
            fmt = cls(apply_chat_template=values["apply_chat_template"], input_template=values["input_template"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a prompt format ({type(exc).__name__}: {exc}); fix or delete it") from None
        if not isinstance(fmt.apply_chat_template, bool) or not isinstance(fmt.input_template, (str, type(None))):
            raise ConfigError(f"{path}: apply_chat_template must be true/false and input_template a string or null")
        return fmt
