"""A JSONL output that a killed job continues without duplicating or tearing a row.

Rows are appended one batch at a time (flushed and fsynced); after each batch a line is appended
to ``<out>.progress.jsonl`` recording how many input items are finished, the output's length in
bytes after their rows, and counters. Its first line holds the job's settings.

A rerun with the same ``--out`` takes the last record whose length fits the file as it is, cuts
the file there (dropping a torn row, a batch written after the last record, or whatever a cut
file ends with) and continues with the next item; the job regenerates what was cut the same way
for a fixed seed. A finished file (its last record says ``"done"``) is left alone. Settings that
change the rows (model, seed, mode, ...) must match the first line's, so one file never mixes
two jobs; a file without a progress log is never overwritten without ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from rlhf.core.errors import NO_SPACE_ERRNOS, ConfigError, RlhfError, no_space, size_text


class ResumableJsonl:
    def __init__(self, path: str | Path, settings: dict[str, Any], *, overwrite: bool = False):
        self.path = Path(path)
        self.log_path = self.path.with_name(self.path.name + ".progress.jsonl")
        self.settings = json.loads(json.dumps(settings, default=str))
        self.done_items, self.rows, self.finished = 0, 0, False
        self.counters: Counter = Counter()
        if self.path.is_dir():
            raise ConfigError(f"--out {self.path} is a directory; this command writes a .jsonl file: give a file "
                              f"name, e.g. --out {self.path / 'rows.jsonl'}")
        if overwrite:
            self.log_path.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)
        if self.log_path.exists():
            self._continue()
        else:
            self._start()

    def _start(self) -> None:
        if self.path.exists() and self.path.stat().st_size > 0:
            raise ConfigError(f"{self.path} exists and was not written by this command (no {self.log_path.name}); "
                            "choose another --out, or pass --overwrite to replace it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")
        _replace(self.log_path, json.dumps({"settings": self.settings}) + "\n" + self._record() + "\n")

    def _continue(self) -> None:
        lines = self.log_path.read_text().split("\n")
        records = []
        for line in lines[1:]:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # the torn last line of a killed job, or the final newline
                break
        try:
            saved = json.loads(lines[0])["settings"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise RlhfError(f"{self.log_path} is damaged; pass --overwrite to start {self.path} again") from None
        changed = sorted(k for k in set(saved) | set(self.settings) if saved.get(k) != self.settings.get(k))
        if changed:
            was = ", ".join(f"{k}={saved.get(k)!r}" for k in changed)
            raise ConfigError(f"{self.path} was started with other settings ({was}); rerun with those, choose "
                            "another --out, or pass --overwrite to start again")
        size = self.path.stat().st_size if self.path.exists() else 0
        fitting = [r for r in records if r["bytes"] <= size]
        if not fitting:
            raise RlhfError(f"{self.log_path} has no usable record; pass --overwrite to start {self.path} again")
        last = fitting[-1]
        with open(self.path, "ab") as handle:  # drop whatever follows the last recorded batch
            handle.truncate(last["bytes"])
        self.done_items, self.rows = last["items"], last["rows"]
        self.counters, self.finished = Counter(last.get("counters", {})), bool(last.get("done"))
        if len(fitting) < len(records) or len(records) < len(lines) - 2:  # keep the log true to the file
            _replace(self.log_path, "".join(line + "\n" for line in lines[: len(fitting) + 1]))

    def append(self, rows: list[dict[str, Any]], items: int, counters: dict[str, int] | None = None) -> None:
        """Write ``rows`` (the output of ``items`` more input items), then record the progress."""
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        _append_whole(self.path, data)
        self.done_items += items
        self.rows += len(rows)
        self.counters.update(counters or {})
        self._log()

    def finish(self) -> None:
        self.finished = True
        self._log()

    def _record(self) -> str:
        record = {"items": self.done_items, "rows": self.rows, "bytes": self.path.stat().st_size,
                  "counters": dict(self.counters)}
        return json.dumps({**record, "done": True} if self.finished else record)

    def _log(self) -> None:
        _append_whole(self.log_path, (self._record() + "\n").encode())


def _append_whole(path: Path, data: bytes) -> None:
    """Append ``data`` and fsync it, or, when that fails (a full disk), cut the file back to what it
    held and raise one line naming it (and the space the rows need)."""
    with open(path, "ab", buffering=0) as handle:  # unbuffered: nothing is left to write on close
        start = handle.tell()
        try:
            view = memoryview(data)
            while view:  # a write short of a full disk returns a count, the next one raises
                view = view[handle.write(view):]
            os.fsync(handle.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):
                handle.truncate(start)
            if exc.errno in NO_SPACE_ERRNOS:
                raise no_space(path, needed=size_text(len(data))) from exc
            raise RlhfError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
