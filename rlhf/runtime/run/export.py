"""Writing the trained models out, the same in every loop and runtime: the trained model (the RL
policy, the fit loop's model) to ``<out>/final`` (and ``best/``) and, with ``--save-critic``, the
critic to ``<out>/critic``, each as the model adapter lays it out (``ModelAdapter.save`` /
``save_critic``); the fit loop's objective may add entries to the saved ``config.json``, and the
run's prompt format goes beside the weights (``prompt_format.json``, rlhf/runtime/run/prompt_format.py),
and beside every model the adapter wrote inside (`inner_models`: a LoRA adapter's merged copy).

Called on every rank of the role: a backend that shards the weights gathers them inside
``full_weights()`` with every rank taking part, while the main rank writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf.core.protocols.adapter import ModelAdapter
from rlhf.core.distributed import DistContext
from rlhf.runtime.run.prompt_format import PromptFormat


def export_model(adapter: ModelAdapter, tokenizer: Any, trained: Any, out_dir: Path, dist: DistContext, *,
                 prompt_format: PromptFormat, config_entries: dict[str, Any] | None = None) -> None:
    """``trained`` (a `TrainedModel`) saved by the adapter with the ``prompt_format`` it was trained
    with; ``config_entries`` merged into its config.json."""
    with trained.backend.full_weights():
        if dist.is_main:
            adapter.save(trained.model, tokenizer, Path(out_dir))
            for model in (Path(out_dir), *inner_models(out_dir)):
                prompt_format.write(model)
    if dist.is_main and config_entries:
        path = Path(out_dir) / "config.json"
        values = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**values, **config_entries}, indent=2, sort_keys=True))


def export_critic(adapter: ModelAdapter, tokenizer: Any, critic: Any, out_dir: Path, dist: DistContext) -> None:
    with critic.backend.full_weights():
        if dist.is_main:
            adapter.save_critic(critic.model, tokenizer, Path(out_dir))


def inner_models(directory: Path) -> list[Path]:
    """The models a model adapter wrote inside an exported model's folder (its subfolders with a
    ``config.json``, e.g. a LoRA adapter's merged copy): they get the folder's prompt format and card."""
    return sorted(p for p in Path(directory).iterdir() if p.is_dir() and (p / "config.json").is_file())
