"""Checkpoints: everything a run needs to continue as if it had never stopped.

``<out>/checkpoints/step_N/`` holds one folder per trained worker (model + optimizer +
scheduler, written by the worker: one copy, or one part per rank for sharded backends), the
trainer state (step, data position) and every rank's RNG state. A checkpoint is written to a
hidden temporary folder and renamed into place, so a crash mid-write never leaves a checkpoint
that looks complete; ``latest_checkpoint`` only sees complete ones. Every file is fsynced before
the rename, and the rename itself after it, so a power loss cannot leave a torn checkpoint either.

Checkpoints hold tensors and plain data only: torch files are read with ``weights_only=True``
(no pickled code runs on ``--resume``), the trainer state is JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import io
from collections.abc import Callable

import torch

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.errors import RlhfError

_NAME = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (loadable with ``weights_only=True``)."""
    import numpy as np

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(mt), gauss],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_tensors(obj: Any, path: Path) -> None:
    """``torch.save`` through memory, so a full disk reports the file and ``No space left on device``
    (torch's own writer says only "iostream error")."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        with open(path, "wb") as handle:
            handle.write(buffer.getbuffer())
    except OSError as exc:
        raise RlhfError(f"cannot write {path}: {exc.strerror or exc}") from exc


def load_tensors(path: Path) -> Any:
    """A file of tensors and plain data; a file that needs pickled code (crafted, or written by
    something else) is refused rather than run."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RlhfError(f"{path} holds more than tensors and plain data, so it is not loaded (it could run code). "
                        "Was it written by this version of rlhf? Detail: " + str(exc).splitlines()[0]) from None


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root``, then the folders, to the disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(tmp: Path, final: Path) -> None:
    """Make the finished folder ``tmp`` appear as ``final`` in one step: fsync, move any old
    ``final`` aside, rename, fsync the parent, then remove the old one."""
    fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_directory(final: Path, write: Callable[[Path], None], dist: DistContext = SINGLE) -> Path:
    """``write(tmp)`` on every rank into a hidden ``.<name>.tmp`` beside ``final``, then (main
    rank) `replace_atomically`: a kill at any moment leaves the old ``final`` or the new one."""
    tmp = final.with_name(f".{final.name}.tmp")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        write(tmp)
        dist.barrier()
        if dist.is_main:
            replace_atomically(tmp, final)
    except OSError as exc:
        raise RlhfError(f"cannot write {exc.filename or final}: {exc.strerror or exc}") from exc
    except RuntimeError as exc:  # torch's own writer (DeepSpeed's checkpoints) says only "iostream error"
        if "PytorchStreamWriter" not in str(exc) and "iostream" not in str(exc):
            raise
        free = shutil.disk_usage(final.parent).free
        reason = "No space left on device" if free < 64 << 20 else str(exc).strip().splitlines()[-1]
        raise RlhfError(f"cannot write {final}: {reason} ({free >> 20} MiB free there)") from exc
    dist.barrier()
    return final


def save_checkpoint(out_dir: Path, step: int, *, workers: dict[str, Any], trainer_state: dict[str, Any],
                    keep: int, dist: DistContext = SINGLE) -> Path:
    """Write ``step_<step>`` atomically (on every rank), then keep only the ``keep`` newest."""
    def write(tmp: Path) -> None:
        for name, worker in workers.items():
            worker.save(tmp / name)
        save_tensors(rng_state(), tmp / f"rng_{dist.rank}.pt")
        if dist.is_main:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))

    final = write_directory(out_dir / "checkpoints" / f"step_{step}", write, dist)
    if dist.is_main:
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
    set_rng_state(load_tensors(path / f"rng_{dist.rank}.pt"))
    return json.loads((path / "trainer_state.json").read_text())
