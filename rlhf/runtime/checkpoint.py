"""Checkpoints: everything a run needs to continue as if it had never stopped.

``<out>/checkpoints/step_N/`` holds one folder per trained worker (model + optimizer +
scheduler, written by the worker: one copy, or one part per rank for sharded backends), the
trainer state (step, data position) and every rank's RNG state. A checkpoint is written to a
hidden temporary folder and renamed into place, so a crash mid-write never leaves a checkpoint
that looks complete; ``latest_checkpoint`` only sees complete ones.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext

_NAME = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, step: int, *, workers: dict[str, Any], trainer_state: dict[str, Any],
                    keep: int, dist: DistContext = SINGLE) -> Path:
    """Write ``step_<step>`` atomically (on every rank), then keep only the ``keep`` newest."""
    root = out_dir / "checkpoints"
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    for name, worker in workers.items():
        worker.save(tmp / name)
    torch.save(rng_state(), tmp / f"rng_{dist.rank}.pt")
    dist.barrier()
    if dist.is_main:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(out_dir: Path) -> list[Path]:
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[-1] if checkpoints else None


def load_checkpoint(path: Path, workers: dict[str, Any], dist: DistContext = SINGLE) -> dict[str, Any]:
    """Restore every worker and this rank's RNG from a checkpoint folder; return the trainer state."""
    for name, worker in workers.items():
        worker.load(path / name)
    set_rng_state(torch.load(path / f"rng_{dist.rank}.pt", weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())
