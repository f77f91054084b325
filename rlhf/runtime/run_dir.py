"""The run directory (DESIGN §11): what a run writes, and how it continues.

    <out>/config.yaml        the resolved config (rerun it with --config)
    <out>/plugins.json       the plugin set and its fingerprint
    <out>/metrics.jsonl, samples.jsonl, tensorboard/   (written by the logger plugins)
    <out>/checkpoints/step_N/                          (checkpoint.py: atomic, rotated)
    <out>/final/             the trained policy (the model adapter's layout)
    <out>/best/              with --save-best: the policy that scored best on the eval, and best.json

Every rank of a data-parallel run holds a `RunDirectory`; only the main rank writes files of its
own, while checkpoints are written by every rank (sharded state) and finished by the main rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.errors import RlhfError
from rlhf.runtime import checkpoint

log = logging.getLogger(__name__)


class RunDirectory:
    def __init__(self, path: Path, dist: DistContext = SINGLE):
        self.path, self.dist = Path(path), dist

    @property
    def final(self) -> Path:
        return self.path / "final"

    def check_free(self, *, resume: bool) -> None:
        """Refuse to start a new run over an existing one (before anything is built)."""
        if self.path.exists() and any(self.path.iterdir()) and not resume:
            raise RlhfError(f"{self.path} already holds a run: pass --resume to continue it, or choose another --out")

    def prepare(self, *, config: dict[str, Any], plugins: dict[str, Any], resume: bool) -> None:
        """Create the directory and write config.yaml and plugins.json (main rank; every rank waits)."""
        if self.dist.is_main:
            import yaml

            self.check_free(resume=resume)
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            (self.path / "plugins.json").write_text(json.dumps(plugins, indent=2))
        self.dist.barrier()

    def write_model(self, directory: Path, export: Callable[[Path], None], *,
                    record: dict[str, Any] | None = None) -> None:
        """``export(tmp)`` on every rank into a directory beside ``directory``, then (main rank) the
        JSON files of ``record`` ({file name: data}) added and the result renamed into place, so a
        reader never sees a half-written model."""
        tmp = directory.with_name(f".{directory.name}.tmp")
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.dist.barrier()
        export(tmp)
        if self.dist.is_main:
            for name, data in (record or {}).items():
                (tmp / name).write_text(json.dumps(data, indent=2))
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if directory.exists():
                os.rename(directory, old)
            os.rename(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        self.dist.barrier()

    def save_checkpoint(self, step: int, roles: dict[str, Any], state: dict[str, Any], *, keep: int) -> Path:
        """``checkpoints/step_<step>``: each role's state, every rank's RNG and the trainer's ``state``."""
        return checkpoint.save_checkpoint(self.path, step, workers=roles, trainer_state=state, keep=keep,
                                          dist=self.dist)

    def resume(self, roles: dict[str, Any]) -> dict[str, Any] | None:
        """Load the latest complete checkpoint into ``roles``; its trainer state (None: there is none)."""
        path = checkpoint.latest_checkpoint(self.path)
        if path is None:
            log.warning("--resume: no complete checkpoint in %s; starting from step 0", self.path)
            return None
        state = checkpoint.load_checkpoint(path, roles, self.dist)
        if state.get("world_size", 1) != self.dist.world_size:
            raise RlhfError(f"{path} was written by {state.get('world_size', 1)} processes; resume it with "
                            f"the same number (this run has {self.dist.world_size})")
        log.info("resumed from %s (step %d)", path, state["step"])
        return state
