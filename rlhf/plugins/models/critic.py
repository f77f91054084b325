"""A critic: a transformer backbone plus a scalar value head on every position (PPO's V(s)).

``values[:, t]`` estimates the return from the state that ends at token t, so with
``values[:, :-1]`` position t lines up with the action that produces token t+1 (docs/architecture.md).
The head is ``nn.Linear(hidden, 1)`` stored under ``value_head_prefix``.

Initialisation (OpenRLHF's ``critic_pretrain``): from a reward-model checkpoint when the critic's
checkpoint has a scalar head, in either layout of docs/rewards.md (a one-label
``*ForSequenceClassification``, whose ``score`` head becomes the value head, or a base model with
``<prefix>.weight``); otherwise (the policy, or any causal LM) a fresh head, N(0, 1/(H+1)) as
OpenRLHF draws it. Layout detection and tensor reading are shared with the reward-model source
(`rlhf.core.checkpoints`).

Saved in OpenRLHF's layout: the backbone's weights (LoRA merged in) plus ``<prefix>.weight``, and
``value_head_prefix`` in config.json, so the critic loads back as a critic and as a reward model.
Deviation from OpenRLHF: values are not normalised by a reward model's stored mean and std.

Shape legend: ``B`` sequences, ``T`` tokens, ``H`` hidden size.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rlhf.api import ConfigError, read_weight, scalar_head_layout
from rlhf.plugins.models.lora import merged_state_dict

log = logging.getLogger(__name__)


class CriticModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, hidden_size: int, value_head_prefix: str = "score",
                 bias: bool = False):
        super().__init__()
        self.backbone = backbone
        self.value_head_prefix = value_head_prefix
        self.initialised_from = "fresh"  # or the reward-model layout its head came from
        head = torch.nn.Linear(hidden_size, 1, bias=bias)
        torch.nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1))
        if bias:
            torch.nn.init.zeros_(head.bias)
        setattr(self, value_head_prefix, head)

    @property
    def head(self) -> torch.nn.Linear:
        """The value head, whatever attribute name (``value_head_prefix``) it is stored under."""
        return getattr(self, self.value_head_prefix)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               use_cache=False).last_hidden_state  # (B, T, H)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()  # (B, T)

    @classmethod
    def from_backbone(cls, backbone: torch.nn.Module, ref: str, *, value_head_prefix: str = "score",
                      trust_remote_code: bool = False) -> CriticModel:
        """A critic on ``backbone`` (loaded from ``ref``), its head read from ``ref`` when it has one."""
        from transformers import AutoConfig

        directory = checkpoint_dir(ref)
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        hidden = backbone.config.hidden_size
        layout = scalar_head_layout(directory, config, value_head_prefix)
        if layout is None:
            critic = cls(backbone, hidden, value_head_prefix)
        else:
            weight = read_weight(directory, f"{layout.prefix}.weight")
            if weight is None or tuple(weight.shape) != (1, hidden):
                found = "missing" if weight is None else f"of shape {tuple(weight.shape)}"
                raise ConfigError(f"{ref}: the {layout.layout} head {layout.prefix}.weight is {found}; a critic "
                                  f"needs shape (1, {hidden}). Set --value-head-prefix to the head's name")
            bias = read_weight(directory, f"{layout.prefix}.bias")
            critic = cls(backbone, hidden, value_head_prefix, bias=bias is not None)
            with torch.no_grad():
                critic.head.weight.copy_(weight)
                if bias is not None:
                    critic.head.bias.copy_(bias.reshape(1))
            critic.initialised_from = layout.layout
        log.info("critic from %s: value head %s", ref,
                 "freshly initialised" if layout is None else f"from the {layout.layout} head {layout.prefix}")
        return critic

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Backbone weights (LoRA merged in) plus ``<prefix>.weight``; config.json names the prefix."""
        out = Path(out_dir)
        backbone = self.backbone
        if hasattr(backbone, "peft_config"):
            state, backbone = merged_state_dict(backbone), backbone.get_base_model()
        else:
            state = dict(backbone.state_dict())
        for name, tensor in self.head.state_dict().items():
            state[f"{self.value_head_prefix}.{name}"] = tensor
        backbone.config.value_head_prefix = self.value_head_prefix
        backbone.save_pretrained(out, state_dict=state)


def checkpoint_dir(ref: str) -> Path:
    """The local folder of a directory or an already downloaded hub model."""
    if Path(ref).is_dir():
        return Path(ref)
    from transformers.utils import cached_file

    return Path(cached_file(ref, "config.json")).parent
