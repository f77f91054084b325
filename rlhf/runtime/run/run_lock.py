"""One run per output: a lock held for the life of a run (docs/runs.md).

A training run locks its ``--out`` directory (``<out>/.rlhf-lock``); ``rlhf generate`` and
``rlhf score`` lock their output file (``.<name>.lock`` beside it); ``rlhf iterate`` its run
directory. A second command on the same output stops at once with one line naming the process
that holds it, and writes nothing. The lock is an OS file lock (``flock``): it goes with the
process, however the process ends; a releaser removes the file while holding it, and a process
that locked a file just removed sees so and locks the new one, so two processes never hold it at
once, however fast runs restart. The file also records who holds it (pid, host, start, command);
a file left by a run that was killed is taken over with a warning naming it (and its host, when
another machine wrote it: a lock over a network file system proves nothing about that machine).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError, RlhfError

log = logging.getLogger(__name__)

LOCK_NAME = ".rlhf-lock"


class RunInUseError(RlhfError):
    """Another process holds the output's lock."""


class RunLock:
    def __init__(self, lock_file: Path, target: Path):
        self.lock_file, self.target = lock_file, target
        self._fd: int | None = None
        self._made: list[Path] = []  # folders made for the lock, innermost first

    @classmethod
    def for_directory(cls, directory: str | Path) -> RunLock:
        directory = Path(directory)
        return cls(directory / LOCK_NAME, directory)

    @classmethod
    def for_file(cls, file: str | Path) -> RunLock:
        file = Path(file)
        return cls(file.parent / f".{file.name}.lock", file)

    def acquire(self) -> RunLock:
        """Take the lock, or raise `RunInUseError` naming its holder (nothing written).

        The lock is the file's, and a releaser removes the file while it still holds it: a process
        that opened the file just before (and locks it just after) holds the lock of a file that is
        gone, so after locking it checks that the path still names the file it locked, and otherwise
        starts again with the file there now (`_lock_current`)."""
        import fcntl

        folder = self.lock_file.parent
        self._made = [p for p in (folder, *folder.parents) if not p.exists()]
        fd = self._lock_current(fcntl)
        left = _read(self.lock_file)
        if left:  # a holder that never released it: killed
            other_host = left.get("host") not in (None, socket.gethostname())
            log.warning("%s: taking over the lock left by %s, which is not running%s", self.target, _describe(left),
                        " (written on another host: make sure no run there still uses this output)"
                        if other_host else "")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": datetime.datetime.now().isoformat(timespec="seconds"),
                                  "command": " ".join(["rlhf", *sys.argv[1:]])}).encode(), 0)
        self._fd = fd
        return self

    def _lock_current(self, fcntl: Any) -> int:
        """Open and lock the lock file until the file locked is the one its path names; the descriptor."""
        while True:
            try:
                self.lock_file.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ConfigError(f"--out {self.target}: cannot write there ({exc.strerror or exc}); choose "
                                  "another --out") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                holder = _describe(_read(self.lock_file))
                raise RunInUseError(f"{self.target} is in use by another run ({holder}): wait for it to end, or "
                                    "choose another --out") from None
            if _same_file(fd, self.lock_file):
                return fd
            os.close(fd)  # its holder removed it as we locked it: the lock is the file there now

    def release(self) -> None:
        """Remove the lock file while still holding it, then let the lock go (a process waiting on the
        removed file finds it gone and locks the path's new one: `acquire`); folders made only for
        it are removed again."""
        if self._fd is None:
            return
        import fcntl

        try:
            if _same_file(self._fd, self.lock_file):
                self.lock_file.unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        for folder in self._made:
            try:
                folder.rmdir()  # only when empty: a run that wrote nothing leaves no folder behind
            except OSError:
                break

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class NoLock:
    """What ranks other than the main one hold (the main rank locks for the run)."""

    def release(self) -> None:
        pass


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _read(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a process that has not said who it is yet"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command')}")
