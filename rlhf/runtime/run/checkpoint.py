"""Checkpoints: everything a run needs to continue as if it had never stopped.

``<out>/checkpoints/step_N/`` holds one folder per trained worker (model + optimizer +
scheduler, written by the worker: one copy, or one part per rank for sharded backends), the
trainer state (step, data position) and every rank's RNG state. A checkpoint is written to a
hidden temporary folder and renamed into place, so a crash mid-write never leaves a checkpoint
that looks complete; ``latest_checkpoint`` only sees complete ones. Every file is fsynced before
the rename, and the rename itself after it, so a power loss cannot leave a torn checkpoint either.
Each such folder (checkpoints, ``final/``, ``best/``) ends with ``MANIFEST.json``, written last:
every file's size and SHA-256. ``--resume`` checks the newest checkpoint against it and falls back
to the newest intact one (`intact_checkpoint`), so a file damaged after the write (a disk error, a
copy cut short) costs the steps since the checkpoint before, not the run.

With ``--save-hf-every N`` a step's folder also holds ``hf/`` (and ``hf_critic/``): the trained
model as ``final/`` is written, loadable by ``from_pretrained``. On a step that is due a checkpoint
too, they are part of it (one write, one manifest); otherwise the step's folder holds them alone
(an *HF-only* folder, written the same way), which ``--resume`` never mistakes for a checkpoint.
Pruning (`prune`) keeps the ``keep`` newest checkpoints, a removed checkpoint's ``hf/`` going with
it, and the ``keep`` newest HF exports among the HF-only folders.

Checkpoints hold tensors and plain data only: torch files are read with ``weights_only=True``
(no pickled code runs on ``--resume``), the trainer state is JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf.core.distributed import SINGLE, DistContext
from rlhf.core.errors import RlhfError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)$")
MANIFEST = "MANIFEST.json"
HF_DIRS = frozenset({"hf", "hf_critic"})  # a step folder's Hugging Face exports (--save-hf-every)


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
    """``torch.save`` into a file this process opened, so a full disk reports the file and ``No space
    left on device`` (torch's writer given a path says only "iostream error"), streamed: the state is
    not copied into memory first (it is the weights and optimizer moments, the size of the model x 3)."""
    try:
        with open(path, "wb") as handle:
            torch.save(obj, handle)
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
    rank) its `write_manifest` and `replace_atomically`: a kill at any moment leaves the old
    ``final`` or the new one."""
    tmp = final.with_name(f".{final.name}.tmp")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        write(tmp)
        dist.barrier()
        if dist.is_main:
            write_manifest(tmp)
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """``folder/MANIFEST.json``: every file under ``folder`` (relative path, bytes, SHA-256)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def manifest_problem(folder: Path) -> str | None:
    """What is wrong with ``folder`` against its manifest, in a few words naming the file; None when
    every file is there with its size and hash (or the folder predates manifests: nothing to check)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    try:
        entries = json.loads(manifest.read_text())["files"]
        expected = {str(name): (int(e["bytes"]), str(e["sha256"])) for name, e in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{manifest} cannot be read ({exc.__class__.__name__})"
    for name, (size, sha) in sorted(expected.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} has {actual:,} bytes where {size:,} were written"
        if _sha256(path) != sha:
            return f"{path} differs from what was written (its SHA-256 changed)"
    return None


def intact_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint whose files match its manifest; each newer damaged one is named in a
    warning. Raises `RlhfError` when checkpoints exist and none is intact."""
    damaged = []
    for path in reversed(list_checkpoints(out_dir)):
        problem = manifest_problem(path)
        if problem is None:
            if damaged:
                log.warning("--resume: %s is damaged (%s); resuming from %s instead", damaged[0][0].name,
                            damaged[0][1], path.name)
            return path
        damaged.append((path, problem))
    if damaged:
        raise RlhfError(f"--resume: no intact checkpoint in {out_dir / 'checkpoints'}: {damaged[0][1]}"
                        + (f" (and {len(damaged) - 1} older one(s) damaged too)" if len(damaged) > 1 else ""))
    return None


def remove_leftovers(out_dir: Path) -> list[Path]:
    """Remove the hidden ``.<name>.tmp``/``.<name>.old`` folders a killed write left in ``out_dir``
    and its ``checkpoints/`` (call only while holding the run's lock: no write is under way)."""
    removed = []
    for folder in (out_dir, out_dir / "checkpoints"):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.is_dir() and path.name.startswith(".") and path.name.endswith((".tmp", ".old")):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def save_checkpoint(out_dir: Path, step: int, *, workers: dict[str, Any], trainer_state: dict[str, Any],
                    keep: int, dist: DistContext = SINGLE, hf: Callable[[Path], None] | None = None) -> Path:
    """Write ``step_<step>`` atomically (on every rank), with ``hf(folder)`` writing its HF exports
    into it when given, then `prune` to the ``keep`` newest."""
    def write(tmp: Path) -> None:
        for name, worker in workers.items():
            worker.save(tmp / name)
        save_tensors(rng_state(), tmp / f"rng_{dist.rank}.pt")
        if dist.is_main:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        if hf is not None:
            hf(tmp)

    final = write_directory(out_dir / "checkpoints" / f"step_{step}", write, dist)
    if dist.is_main:
        prune(out_dir, keep)
    dist.barrier()
    return final


def save_hf_only(out_dir: Path, step: int, hf: Callable[[Path], None], *, keep: int,
                 dist: DistContext = SINGLE) -> Path:
    """``step_<step>`` holding only the HF exports ``hf(folder)`` writes (a step that is due no
    checkpoint), written atomically like one, then `prune`."""
    final = write_directory(out_dir / "checkpoints" / f"step_{step}", hf, dist)
    if dist.is_main:
        prune(out_dir, keep)
    dist.barrier()
    return final


def prune(out_dir: Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest checkpoints (each with its HF exports), then the HF-only
    folders that are not among the ``keep`` newest HF exports; ``keep`` 0 keeps everything."""
    if keep <= 0:
        return []
    removed = list_checkpoints(out_dir)[:-keep]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    stale = [p for p in list_hf_exports(out_dir)[:-keep] if is_hf_only(p)]
    for old in stale:
        shutil.rmtree(old, ignore_errors=True)
    return removed + stale


def _step_folders(out_dir: Path) -> list[Path]:
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def is_hf_only(path: Path) -> bool:
    """A step folder that holds HF exports and no training state (not a checkpoint)."""
    names = {p.name for p in path.iterdir()} - {MANIFEST}
    return bool(names) and names <= HF_DIRS


def list_checkpoints(out_dir: Path) -> list[Path]:
    """The step folders that are checkpoints, oldest first (HF-only folders left out)."""
    return [p for p in _step_folders(out_dir) if not is_hf_only(p)]


def list_hf_exports(out_dir: Path) -> list[Path]:
    """The step folders that hold an ``hf/`` export (checkpoints or HF-only), oldest first."""
    return [p for p in _step_folders(out_dir) if (p / "hf").is_dir()]


def latest_checkpoint(out_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[-1] if checkpoints else None


def load_checkpoint(path: Path, workers: dict[str, Any], dist: DistContext = SINGLE) -> dict[str, Any]:
    """Restore every worker and this rank's RNG from a checkpoint folder; return the trainer state.
    A file that cannot be read is one `RlhfError` naming it."""
    try:
        for name, worker in workers.items():
            worker.load(path / name)
        set_rng_state(load_tensors(path / f"rng_{dist.rank}.pt"))
        return json.loads((path / "trainer_state.json").read_text())
    except RlhfError:
        raise
    except Exception as exc:  # torch's, safetensors' or DeepSpeed's reader on a damaged file
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise RlhfError(f"cannot load the checkpoint {path}: {detail}. Delete that folder to resume from the "
                        "one before it") from exc
