"""Small facts about transformers models that the runtime and plugins both need. No torch at import.

* `base_model`: the transformers model inside a PEFT wrapper (or the model itself). PEFT's
  forward passes keyword arguments through, but its signature hides the inner model's.
* `innermost`: the model under training wrappers (DeepSpeed, DDP) and PEFT's.
* `accepts_logits_to_keep`: whether a model class's forward takes ``logits_to_keep`` (project
  only the last positions to the vocabulary), cached per class.
* `cache_argument`: the name a model class's forward takes its KV cache by (``cache`` from
  transformers 5.2x, which deprecates ``past_key_values``; ``past_key_values`` before).
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any


def base_model(model: Any) -> Any:
    """The model a PEFT wrapper holds, or ``model`` when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@lru_cache(maxsize=None)
def accepts_logits_to_keep(forward_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(forward_cls.forward).parameters


@lru_cache(maxsize=None)
def cache_argument(forward_cls: type) -> str:
    return "cache" if "cache" in inspect.signature(forward_cls.forward).parameters else "past_key_values"


def innermost(model: Any) -> Any:
    """The model under training wrappers (DeepSpeed's engine, DDP: ``.module``) and PEFT's wrapper."""
    import torch

    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return base_model(model)
