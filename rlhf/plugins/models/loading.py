"""What loading a transformers model involves beyond ``from_pretrained``: device and dtype choice,
the attention kernel check, activation checkpointing, a pad token, a chat template, quiet logs.
Shared by the ``hf`` adapter (``hf.py``) and LoRA (``lora.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlhf.api import ConfigError, check_model_ref, reading_weights, resolve_device

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
ATTENTION = ("sdpa", "eager", "flash_attention_2")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def is_installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_attention(name: str, device: torch.device | None) -> None:
    """A known kernel; flash_attention_2 needs the flash-attn package and a CUDA device (checked when
    ``device`` is given: where the models load); say so before loading anything."""
    if name not in ATTENTION:
        raise ConfigError(f"--attn-implementation must be one of {', '.join(ATTENTION)}; got {name!r}")
    if name != "flash_attention_2" or device is None:
        return
    if not is_installed("flash_attn"):
        raise ConfigError("--attn-implementation flash_attention_2 needs the flash-attn package "
                          "(pip install flash-attn --no-build-isolation); or use --attn-implementation sdpa")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError("--attn-implementation flash_attention_2 runs on a CUDA GPU only; "
                          f"this run's device is {device}. Use --attn-implementation sdpa")


@contextlib.contextmanager
def loading_errors(ref: str, *, weights: bool = True) -> Iterator[None]:
    """``from_pretrained`` failures as one line naming the model (transformers raises OSError);
    ``weights=False`` for a tokenizer, whose directory needs no config.json."""
    check_model_ref(ref, weights=weights)
    try:
        with reading_weights(ref):
            yield
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot load the model {ref}: {first}") from exc


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing: gradients reach adapters even when the inputs need none."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def set_pad_token(tokenizer: Any, ref: str) -> None:
    """Padding needs a token id; many causal LMs ship without one. EOS is masked out wherever it pads."""
    if tokenizer.pad_token_id is not None:
        return
    for fallback in (tokenizer.eos_token, tokenizer.unk_token):
        if fallback is not None:
            tokenizer.pad_token = fallback
            return
    raise ConfigError(f"the tokenizer of {ref} has no pad, EOS or UNK token to pad with; "
                      "pass --tokenizer with a tokenizer that defines one")


def read_chat_template(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--chat-template {path}: no such file (expected a Jinja template)")
    return file.read_text()


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence load reports that are expected (a causal LM checkpoint's lm_head when loading a backbone)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
