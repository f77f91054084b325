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
copy cut short) costs the steps since the checkpoint before, not the run; the damaged ones are set
aside (``step_N.damaged``), so pruning never keeps them in place of an intact one. A write that
fails (a full disk: one line with the space needed) removes its temporary folder and leaves the
checkpoints before it as they were.

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

import contextlib
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
from rlhf.core.errors import RlhfError, free_space, no_space, says_no_space, size_text

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
    """``torch.save`` into a file this process opened, so a failed write names the file (torch's
    writer given a path says only "iostream error", and on a full disk "unexpected pos"), streamed:
    the state is not copied into memory first (it is the weights and optimizer moments, the size of
    the model x 3). A full disk is left to `write_directory` to report, with the space needed."""
    try:
        with open(path, "wb") as handle:
            torch.save(obj, handle)
    except OSError as exc:
        raise _write_failed(path, exc.strerror or str(exc)) from exc
    except RuntimeError as exc:
        if not _torch_writer_failed(exc):
            raise
        raise _write_failed(path, str(exc).strip().splitlines()[-1]) from exc


def _write_failed(path: Path, reason: str) -> RlhfError:
    error = RlhfError(f"cannot write {path}: {reason}")
    error.filename = str(path)  # type: ignore[attr-defined]  # read by write_directory
    return error


def _torch_writer_failed(exc: BaseException) -> bool:
    """torch's zip writer failing (a full disk shows as "unexpected pos", "iostream error" or
    "PytorchStreamWriter failed writing file")."""
    text = str(exc)
    return any(mark in text for mark in ("PytorchStreamWriter", "iostream", "inline_container", "unexpected pos"))


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


def write_directory(final: Path, write: Callable[[Path], None], dist: DistContext = SINGLE,
                    run: dict[str, Any] | None = None) -> Path:
    """``write(tmp)`` on every rank into a hidden ``.<name>.tmp`` beside ``final``, then (main
    rank) its `write_manifest` (with the run's identity ``run``, for a checkpoint) and `replace_atomically`: a kill at any moment leaves the old
    ``final`` or the new one. A write that fails removes the temporary folder; a full disk is one
    `NoSpaceError` naming the file and the space the folder needs (`_write_error`)."""
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        write(tmp)
        dist.barrier()
        if dist.is_main:
            write_manifest(tmp, run)
            replace_atomically(tmp, final)
    except Exception as exc:
        error = _write_error(final, tmp, exc) if dist.is_main else None
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise
        raise error from exc
    dist.barrier()
    return final


def _write_error(final: Path, tmp: Path, exc: Exception) -> RlhfError | None:
    """The one line for a failed write of ``final`` (None: ``exc`` is no write error; raise it as it is).
    A full disk names the file and the space needed: about the size of the folder it replaces, or
    of the newest folder beside it (a checkpoint weighs what the one before weighed), or at least
    what was written before the disk filled."""
    filename = next((getattr(e, "filename", None) for e in _chain(exc) if getattr(e, "filename", None)), None)
    where = final
    if filename is not None:  # the file as it would have been named once in place
        try:
            where = final / Path(filename).relative_to(tmp)
        except ValueError:
            where = Path(filename)
    free = free_space(final.parent)
    writer_failed = any(_torch_writer_failed(e) for e in _chain(exc))
    if says_no_space(exc) or (writer_failed and free is not None and free < 64 << 20):
        written = _folder_bytes(tmp)
        reference = final if final.is_dir() else _newest_sibling(final)
        size = _folder_bytes(reference) if reference is not None else 0
        needed = f"about {size_text(size)}" if size > written else f"more than {size_text(written)}"
        return no_space(where, needed=needed, free=None if free is None else free + written)
    if isinstance(exc, RlhfError):
        return None
    if isinstance(exc, OSError):
        return RlhfError(f"cannot write {where}: {exc.strerror or exc}")
    if writer_failed:
        return RlhfError(f"cannot write {where}: {str(exc).strip().splitlines()[-1]}")
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _folder_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder`` (0 for none)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _newest_sibling(final: Path) -> Path | None:
    """The newest ``step_N`` folder beside the step folder ``final`` (None for other folders, or none)."""
    if not _NAME.match(final.name):
        return None
    siblings = _step_folders(final.parent.parent)
    return siblings[-1] if siblings else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, run: dict[str, Any] | None = None) -> None:
    """``folder/MANIFEST.json``: every file under ``folder`` (relative path, bytes, SHA-256), and for a
    checkpoint the identity of the run that wrote it (``run``, rlhf/runtime/config/identity.py)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries, **({"run": run} if run is not None else {})},
                                              indent=1))


def recorded_identity(folder: Path) -> tuple[bool, dict[str, Any] | None]:
    """``(readable, identity)`` of the checkpoint ``folder``: whether its manifest could be read, and
    the run identity it records (None: written before identities were, or unreadable)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False, None
    run = manifest.get("run") if isinstance(manifest, dict) else None
    return isinstance(manifest, dict), run if isinstance(run, dict) else None


def manifest_problem(folder: Path, *, quick: bool = False) -> str | None:
    """What is wrong with ``folder`` against its manifest, in a few words naming the file; None when
    every file is there with its size and hash (or the folder predates manifests: nothing to check).
    ``quick``: sizes only, no hashes (reads no file but the manifest)."""
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
        if not quick and _sha256(path) != sha:
            return f"{path} differs from what was written (its SHA-256 changed)"
    return None


def checkpoint_problem(folder: Path, checkpoints: list[Path], *, quick: bool = False) -> str | None:
    """`manifest_problem`, and a checkpoint without a manifest among ``checkpoints`` of which some have
    one is damaged too: a copy cut short before its last file (a checkpoint of an rlhf from before
    manifests sits only among others without one)."""
    if not (folder / MANIFEST).is_file():
        if any((other / MANIFEST).is_file() for other in checkpoints):
            return f"{folder / MANIFEST} is missing (a write or copy that did not finish)"
        return None
    return manifest_problem(folder, quick=quick)


def intact_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint whose files match its manifest. Each damaged one found on the way (and
    each older one whose files have lost bytes) is set aside (`set_aside`) with a warning naming it,
    so that pruning never counts it among the checkpoints it keeps. Raises `RlhfError` when
    checkpoints exist and none is intact (then nothing is set aside)."""
    checkpoints = list_checkpoints(out_dir)
    damaged: list[tuple[Path, str]] = []
    for index in range(len(checkpoints) - 1, -1, -1):
        path = checkpoints[index]
        problem = checkpoint_problem(path, checkpoints)
        if problem is not None:
            damaged.append((path, problem))
            continue
        if damaged:
            names = ", ".join(p.name for p, _ in damaged)
            aside = ", ".join(set_aside(p).name for p, _ in damaged)
            log.warning("--resume: %s %s damaged (%s); resuming from %s instead. Set aside as checkpoints/%s "
                        "(delete it once you no longer need it)", names, "is" if len(damaged) == 1 else "are",
                        damaged[0][1], path.name, aside)
        for older in checkpoints[:index]:  # sizes only: hashing every checkpoint would read them all
            problem = checkpoint_problem(older, checkpoints, quick=True)
            if problem is not None:
                log.warning("--resume: the older checkpoint %s is damaged (%s); set aside as checkpoints/%s",
                            older.name, problem, set_aside(older).name)
        return path
    if damaged:
        raise RlhfError(f"--resume: no intact checkpoint in {out_dir / 'checkpoints'}: {damaged[0][1]}"
                        + (f" (and {len(damaged) - 1} older one(s) damaged too)" if len(damaged) > 1 else ""))
    return None


def set_aside(path: Path) -> Path:
    """Rename the damaged checkpoint ``step_N`` to ``step_N.damaged`` (``step_N.damaged-2``, ...): no
    longer a checkpoint to resume from or to count when pruning, and its files are still there."""
    target = path.with_name(f"{path.name}.damaged")
    count = 1
    while target.exists():
        count += 1
        target = path.with_name(f"{path.name}.damaged-{count}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def remove_leftovers(out_dir: Path) -> list[Path]:
    """Clean up what a killed write left in ``checkpoints/`` (call only while holding the run's lock:
    no write is under way): a ``.step_N.tmp`` or ``.step_N.pruned`` folder is removed, and a
    ``.step_N.old`` one too, unless ``step_N`` itself is missing (the kill came between the two
    renames of `replace_atomically`): then it is put back. Other names there are not the run's and stay."""
    return clean_leftovers(out_dir / "checkpoints", lambda name: _NAME.match(name) is not None)


def clean_leftovers(folder: Path, owns: Callable[[str], bool]) -> list[Path]:
    """In ``folder``: remove each ``.<name>.tmp`` (file or folder), ``.<name>.old`` and
    ``.<name>.pruned`` folder left by a write (or a removal) of an entry ``name`` that ``owns`` says is
    the run's; an ``.old`` whose ``name`` is missing is renamed back instead. Returns what was
    removed or put back."""
    found: list[Path] = []
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        name, dot, suffix = path.name[1:].rpartition(".")
        if not path.name.startswith(".") or not dot or suffix not in ("tmp", "old", "pruned") or not owns(name):
            continue
        if suffix == "old" and not (folder / name).exists():
            os.rename(path, folder / name)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        found.append(path)
    return found


def save_checkpoint(out_dir: Path, step: int, *, workers: dict[str, Any], trainer_state: dict[str, Any],
                    keep: int, dist: DistContext = SINGLE, hf: Callable[[Path], None] | None = None,
                    run: dict[str, Any] | None = None) -> Path:
    """Write ``step_<step>`` atomically (on every rank), with ``hf(folder)`` writing its HF exports
    into it when given and the run's identity ``run`` in its manifest, then `prune` to the ``keep`` newest."""
    def write(tmp: Path) -> None:
        for name, worker in workers.items():
            worker.save(tmp / name)
        save_tensors(rng_state(), tmp / f"rng_{dist.rank}.pt")
        if dist.is_main:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        if hf is not None:
            hf(tmp)

    final = write_directory(out_dir / "checkpoints" / f"step_{step}", write, dist, run)
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
        remove_whole(old)
    stale = [p for p in list_hf_exports(out_dir)[:-keep] if is_hf_only(p)]
    for old in stale:
        remove_whole(old)
    return removed + stale


def remove_whole(folder: Path) -> None:
    """Remove ``folder`` in one step as a reader sees it: renamed to a hidden ``.<name>.pruned`` first
    (removed by the next run, `remove_leftovers`, if a kill comes before it is gone), so that no
    half-removed checkpoint is ever left to pass for one."""
    trash = folder.with_name(f".{folder.name}.pruned")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


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
