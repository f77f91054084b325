"""Writing the trained models out, the same in every loop and runtime: the trained model (the RL
policy, the fit loop's model) to ``<out>/final`` (and ``best/``) and, with ``--save-critic``, the
critic to ``<out>/critic``, each as the model adapter lays it out (``ModelAdapter.save`` /
``save_critic``); the fit loop's objective may add entries to the saved ``config.json``, and the
run's prompt format goes beside the weights (``prompt_format.json``, rlhf/runtime/run/prompt_format.py).

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
            prompt_format.write(Path(out_dir))
    if dist.is_main and config_entries:
        path = Path(out_dir) / "config.json"
        values = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**values, **config_entries}, indent=2, sort_keys=True))


def export_critic(adapter: ModelAdapter, tokenizer: Any, critic: Any, out_dir: Path, dist: DistContext) -> None:
    with critic.backend.full_weights():
        if dist.is_main:
            adapter.save_critic(critic.model, tokenizer, Path(out_dir))
