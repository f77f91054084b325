"""The ``hf`` model adapter: any ``AutoModelForCausalLM`` directory or hub name.

Roles: ``policy`` (trainable), ``reference`` (frozen copy, eval mode), ``critic`` (the same
backbone with a scalar value head, see `critic.py`). ``dtype="auto"`` means bfloat16 on a GPU
and float32 on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class HFModelConfig:
    dtype: str = field(default="auto", metadata={"help": "auto, float32, bfloat16 or float16"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code shipped with the checkpoint"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward"})
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa, eager or flash_attention_2"})
    value_head_prefix: str = field(default="value_head", metadata={"help": "Attribute name of the critic's head"})


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


class HFModelAdapter:
    """Loads policy, reference and critic models with transformers' Auto classes."""

    def __init__(self, config: HFModelConfig | None = None):
        self.config = config or HFModelConfig()
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)

    def _kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"dtype": self.dtype, "trust_remote_code": self.config.trust_remote_code}
        if self.config.attn_implementation:
            kwargs["attn_implementation"] = self.config.attn_implementation
        return kwargs

    def load_tokenizer(self, ref: str) -> Any:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=self.config.trust_remote_code)
        if tokenizer.pad_token_id is None:  # many causal LMs ship without one
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def save(self, model: torch.nn.Module, tokenizer: Any, out_dir: Any) -> None:
        """Write the trained policy as an HF directory that ``from_pretrained`` (and vLLM) load."""
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    def load(self, ref: str, *, role: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if role == "critic":
            from rlhf.plugins.models.critic import CriticModel

            model = CriticModel.from_pretrained(ref, value_head_prefix=self.config.value_head_prefix, **self._kwargs())
        elif role in ("policy", "reference"):
            model = AutoModelForCausalLM.from_pretrained(ref, **self._kwargs())
        else:
            raise ValueError(f"the hf adapter builds policy, reference and critic models, not {role!r}")
        model.to(self.device)
        if role == "reference":
            model.eval().requires_grad_(False)
        elif self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        return model
