"""Checkpoints: everything a run needs to continue as if it had never stopped.

``<out>/checkpoints/step_N/`` holds the worker states (model + optimizer + scheduler), the
trainer state (step, data position, counters) and every RNG state. A checkpoint is written to a
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
                    keep: int) -> Path:
    """Write ``step_<step>`` atomically, then delete all but the ``keep`` newest checkpoints."""
    root = out_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, state in workers.items():
        torch.save(state, tmp / f"{name}.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
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


def load_checkpoint(path: Path, worker_names: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(worker states, trainer state, rng state) of a checkpoint folder."""
    states = {name: torch.load(path / f"{name}.pt", map_location="cpu", weights_only=False) for name in worker_names}
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rng = torch.load(path / "rng.pt", weights_only=False)
    return states, trainer_state, rng
