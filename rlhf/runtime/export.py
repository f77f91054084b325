"""Writing the trained models out, the same in both runtimes: the policy to ``<out>/final`` and,
with ``--save-critic``, the critic to ``<out>/critic``, each as the model adapter lays it out
(``ModelAdapter.save`` / ``save_critic``).

Called on every rank of the role: a backend that shards the weights gathers them inside
``full_weights()`` with every rank taking part, while the main rank writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf.core.adapter import ModelAdapter
from rlhf.core.distributed import DistContext


def export_policy(adapter: ModelAdapter, tokenizer: Any, policy: Any, out_dir: Path, dist: DistContext) -> None:
    with policy.backend.full_weights():
        if dist.is_main:
            adapter.save(policy.model, tokenizer, Path(out_dir))


def export_critic(adapter: ModelAdapter, tokenizer: Any, critic: Any, out_dir: Path, dist: DistContext) -> None:
    with critic.backend.full_weights():
        if dist.is_main:
            adapter.save_critic(critic.model, tokenizer, Path(out_dir))
