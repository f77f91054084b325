"""A critic: a transformer backbone plus a scalar value head on every position.

``values[:, t]`` estimates the return from the state that ends at token t, so with
``values[:, :-1]`` position t lines up with the action that produces token t+1 (DESIGN §4).
The head is a ``Linear(hidden, 1)`` stored under ``value_head_prefix`` (OpenRLHF checkpoints
use ``score``), initialised from a checkpoint that has it or freshly otherwise.

Shape legend: ``B`` sequences, ``T`` tokens, ``H`` hidden size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class CriticModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, hidden_size: int, value_head_prefix: str = "value_head"):
        super().__init__()
        self.backbone = backbone
        self.value_head_prefix = value_head_prefix
        head = torch.nn.Linear(hidden_size, 1, bias=False)
        torch.nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1))
        setattr(self, value_head_prefix, head)

    @property
    def head(self) -> torch.nn.Linear:
        """The value head, whatever attribute name (``value_head_prefix``) it is stored under."""
        return getattr(self, self.value_head_prefix)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def gradient_checkpointing_enable(self) -> None:
        self.backbone.gradient_checkpointing_enable()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()  # (B, T)

    @classmethod
    def from_pretrained(cls, ref: str, *, value_head_prefix: str = "value_head", **kwargs: Any) -> CriticModel:
        from transformers import AutoConfig, AutoModel

        from transformers.utils import logging as hf_logging

        config = AutoConfig.from_pretrained(ref, trust_remote_code=kwargs.get("trust_remote_code", False))
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # a causal LM checkpoint has an lm_head the backbone drops: expected
        try:
            backbone = AutoModel.from_pretrained(ref, **kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        critic = cls(backbone, config.hidden_size, value_head_prefix).to(kwargs.get("dtype", torch.float32))
        head_file = Path(ref) / "value_head.pt"
        if head_file.is_file():  # saved by `save_pretrained` below
            critic.head.load_state_dict(torch.load(head_file, map_location="cpu"))
        return critic

    def save_pretrained(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        self.backbone.save_pretrained(out)
        torch.save(self.head.state_dict(), out / "value_head.pt")
        (out / "critic.json").write_text(json.dumps({"value_head_prefix": self.value_head_prefix}))
