"""What a run owns in its directory: the run manifest ``<out>/.rlhf-run.json`` (docs/runs.md).

A run directory may hold files the run did not write: a user's notes, ``rlhf generate --out
<run>/gen_step_4.jsonl``, a plot. A run records the name of every top-level entry it writes
before writing it (the host's own names as the run starts, a log as a plugin opens it with
``run.claim``), and touches nothing else: ``--resume`` cuts back only its own logs, clean-up
removes only what its own writes left. Which makes an ``--out`` one of three things
(`classify`):

* ``new``: absent, or empty (a lock file aside): a run may start there;
* ``run``: it holds a run manifest, or the files every run wrote before manifests existed
  (`Layout.marks`: ``config.yaml`` and ``plugins.json`` for a training run); such a run owns
  the names runs of that kind wrote (`Layout.legacy`) and its manifest is written when it
  continues;
* ``foreign``: anything else, a folder of other files: no command writes a run into it (the
  caller refuses it with one line, exit 2, before writing anything).

Only the main rank reads and writes the manifest.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlhf.core.errors import ConfigError, RlhfError
from rlhf.runtime.run.run_lock import LOCK_NAME

RUN_MANIFEST = ".rlhf-run.json"
# A write probe (RunDirectory._writable) and a manifest a kill cut short: neither makes a folder a run's.
_TRANSIENT = re.compile(r"^(\.write-test-\d+|\.rlhf-run\.json\.tmp)$")


@dataclass(frozen=True)
class Layout:
    """The names one kind of run writes at the top of its directory (regular expressions, whole names).

    ``marks``: each is matched by some entry of every directory a run of this kind wrote before
    manifests existed; ``legacy``: what such a run owns; ``legacy_logs``: which of those are logs
    (cut back on ``--resume``)."""

    kind: str
    marks: tuple[str, ...]
    legacy: tuple[str, ...]
    legacy_logs: tuple[str, ...] = ()

    def matches(self, patterns: Iterable[str], name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in patterns)


Kind = Literal["new", "run", "foreign"]


def entries(path: Path) -> list[str]:
    """The names at the top of ``path`` that say something about it (a lock file and a write probe do not)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_NAME and not _TRANSIENT.match(p.name))


# What a training run (rlhf train, rlhf fit) writes at the top of its directory, and what one from before run
# manifests owns.
TRAINING = Layout(kind="training", marks=(r"config\.yaml", r"plugins\.json"),
                  legacy=(r"config\.yaml", r"config\.until_step_\d+\.yaml", r"plugins\.json", r"metrics\.jsonl",
                          r"samples\.jsonl", "tensorboard", "wandb", "checkpoints", "final", "best", "critic"),
                  legacy_logs=(r"metrics\.jsonl", r"samples\.jsonl"))

def classify(path: Path, layout: Layout) -> Kind:
    """``new``, ``run`` or ``foreign`` (the module docstring)."""
    names = entries(path)
    if not names:
        return "new"
    if RUN_MANIFEST in names:  # a run's, if of this kind (``rlhf train --out`` of an ``rlhf iterate`` run is not)
        try:
            kind = json.loads((path / RUN_MANIFEST).read_text()).get("kind", layout.kind)
        except (OSError, ValueError, AttributeError):
            return "run"  # damaged: `RunFiles.read` says so
        return "run" if kind == layout.kind else "foreign"
    if all(any(re.fullmatch(mark, name) for name in names) for mark in layout.marks):
        return "run"
    return "foreign"


def check_not_foreign(path: Path, layout: Layout, option: str = "--out") -> None:
    """Refuse (`ConfigError`, exit 2) a file, and a folder that is not empty and holds no run of this kind."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{option} {path} is a file; a run writes into a folder: choose another {option}")
    if classify(path, layout) != "foreign":
        return
    names = entries(path)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ConfigError(f"{option} {path} is not empty and holds no run ({shown}): a run writes into a new or empty "
                      f"folder and owns it; choose another {option}")


class RunFiles:
    """The manifest of one run directory: the names the run owns, and which of them are logs."""

    def __init__(self, path: Path, layout: Layout, owned: set[str], logs: set[str], recorded: bool):
        self.path, self.layout = Path(path), layout
        self.owned, self.logs, self.recorded = owned, logs, recorded
        self._lock = threading.Lock()  # loggers may claim from the threads of --async

    @classmethod
    def read(cls, path: Path, layout: Layout) -> RunFiles | None:
        """The run in ``path`` (one from before manifests: owning the names `Layout.legacy` matches);
        None where ``path`` holds no run (new, or foreign)."""
        path = Path(path)
        if classify(path, layout) != "run":
            return None
        manifest = path / RUN_MANIFEST
        if manifest.is_file():
            try:
                data = json.loads(manifest.read_text())
                return cls(path, layout, set(map(str, data["owned"])), set(map(str, data["logs"])), True)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise RlhfError(f"{manifest} cannot be read ({exc.__class__.__name__}): it records which files of "
                                f"{path} the run wrote; restore it from a copy, or move the run's files to a new "
                                "folder") from None
        names = entries(path)
        owned = {n for n in names if layout.matches(layout.legacy, n)}
        logs = {n for n in names if layout.matches(layout.legacy_logs, n)}
        return cls(path, layout, owned, logs, False)

    @classmethod
    def open(cls, path: Path, layout: Layout) -> RunFiles:
        """The run in ``path`` to write into: its manifest, or a new one (a new run, or one from before
        manifests); the caller has refused a foreign ``path`` (`check_not_foreign`)."""
        found = cls.read(path, layout)
        files = found or cls(Path(path), layout, set(), set(), False)
        if not files.recorded:
            files.save()
        return files

    def owns(self, name: str) -> bool:
        """Whether the run wrote (or will write) ``name`` at the top of its directory."""
        return name in self.owned or (not self.recorded and self.layout.matches(self.layout.legacy, name))

    def claim(self, *names: str, log: bool = False) -> None:
        """Record ``names`` as the run's before they are written (``log``: JSON-lines logs, which
        ``--resume`` cuts back)."""
        with self._lock:
            new_owned, new_logs = set(names) - self.owned, (set(names) - self.logs if log else set())
            if not new_owned and not new_logs:
                return
            self.owned |= new_owned
            self.logs |= new_logs
            self.save()

    def existing_logs(self) -> list[Path]:
        return [self.path / name for name in sorted(self.logs) if (self.path / name).is_file()]

    def save(self) -> None:
        """Write the manifest whole (temporary file, fsync, rename)."""
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / RUN_MANIFEST
        tmp = target.with_name(f"{target.name}.tmp")
        text = json.dumps({"kind": self.layout.kind, "owned": sorted(self.owned), "logs": sorted(self.logs)},
                          indent=1)
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise RlhfError(f"cannot write {target}: {exc.strerror or exc}") from exc
        self.recorded = True
