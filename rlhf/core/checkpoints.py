"""Reading weights and head layouts out of a saved Hugging Face model directory.

Shared by the reward-model source (`rlhf.rewards`) and the critic (`rlhf.plugins.models`),
which load the same two checkpoint layouts (docs/rewards.md):

* ``classifier``: a ``*ForSequenceClassification`` directory with one label; its linear head is
  ``score`` (every causal-LM family in transformers names it so);
* ``base_and_head``: OpenRLHF's layout (``get_llm_for_sequence_regression``, and the critic this
  project saves): the base transformer plus ``nn.Linear(hidden, 1, bias=False)`` saved under a
  prefix, ``value_head_prefix`` in config.json when present, else the caller's default.

Only single tensors are read here (safetensors, sharded or not, or ``pytorch_model.bin``), so
nothing builds a model to find a head. torch and safetensors are imported inside functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError


class MissingWeightsError(ConfigError):
    """A model directory without any weight file this module can read."""


def weight_names(path: str | Path) -> list[str]:
    """Every tensor name stored in a checkpoint directory."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    if (path / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
            return list(handle.keys())
    if (path / "pytorch_model.bin").is_file():
        return list(_bin_state(path))
    raise MissingWeightsError(f"{path} holds no model.safetensors or pytorch_model.bin")


def read_weight(path: str | Path, key: str) -> Any:
    """The tensor ``key`` of a checkpoint directory, or None when the checkpoint has no such tensor."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file() or (path / "model.safetensors").is_file():
        from safetensors import safe_open

        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            if key not in weight_map:
                return None
            file = path / weight_map[key]
        else:
            file = path / "model.safetensors"
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(key) if key in handle.keys() else None
    if (path / "pytorch_model.bin").is_file():
        return _bin_state(path).get(key)
    raise MissingWeightsError(f"{path} holds no model.safetensors or pytorch_model.bin")


def top_level_weights(path: str | Path) -> list[str]:
    """Names like ``score.weight``: the candidates for a linear head (``<prefix>.weight``)."""
    return sorted(k for k in weight_names(path) if k.count(".") == 1 and k.endswith(".weight"))


@dataclass(frozen=True)
class HeadLayout:
    """Where a scalar head lives in a checkpoint: ``layout`` is ``classifier`` or ``base_and_head``."""

    layout: str
    prefix: str  # the head's weight is ``<prefix>.weight`` (and ``<prefix>.bias`` if it has one)


def scalar_head_layout(path: str | Path, config: Any, default_prefix: str) -> HeadLayout | None:
    """The layout of a reward-model (or critic) checkpoint, or None for a model without a scalar head.

    ``config`` is the checkpoint's transformers config. A classifier must have one label.
    """
    declared = getattr(config, "value_head_prefix", None)
    if declared:
        return HeadLayout("base_and_head", declared)
    if any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or [])):
        labels = getattr(config, "num_labels", 1)
        if labels != 1:
            raise ConfigError(f"{path} is a classifier with {labels} labels; a reward model or critic has exactly one")
        return HeadLayout("classifier", "score")
    if f"{default_prefix}.weight" in weight_names(path):
        return HeadLayout("base_and_head", default_prefix)
    return None


def _bin_state(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
