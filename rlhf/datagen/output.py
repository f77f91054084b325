"""A JSONL output that a killed job continues without duplicating or tearing a row.

Rows are appended one batch at a time, flushed and fsynced; then ``<out>.progress.json`` is
replaced atomically with the number of input items finished, the file's length after them,
counters, and the job's settings. A rerun truncates the file to the recorded length (dropping a
torn row or a batch written after the last record: the job regenerates it, the same way for a
fixed seed) and continues with the next item. A finished file keeps its progress record (with
``"done": true``); a rerun then only reports it. Settings that change the rows (model, seed,
mode, ...) must match the record's, or the job refuses to mix two outputs in one file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from rlhf.core.errors import RlhfError


class ResumableJsonl:
    def __init__(self, path: str | Path, settings: dict[str, Any], *, overwrite: bool = False):
        self.path = Path(path)
        self.state_path = self.path.with_name(self.path.name + ".progress.json")
        self.settings = json.loads(json.dumps(settings, default=str))
        self.done_items, self.rows, self.finished = 0, 0, False
        self.counters: Counter = Counter()
        if overwrite:
            self.state_path.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)
        self._open()

    def _open(self) -> None:
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else None
        if state is None:
            if self.path.exists() and self.path.stat().st_size > 0:
                raise RlhfError(f"{self.path} exists and was not written by this command (no {self.state_path.name}); "
                                  "choose another --out, or pass --overwrite to replace it")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(b"")
            self._record()
            return
        changed = sorted(k for k in set(state["settings"]) | set(self.settings)
                         if state["settings"].get(k) != self.settings.get(k))
        if changed:
            was = ", ".join(f"{k}={state['settings'].get(k)!r}" for k in changed)
            raise RlhfError(f"{self.path} was started with other settings ({was}); rerun with those, choose "
                              "another --out, or pass --overwrite to start again")
        if not self.path.exists() or self.path.stat().st_size < state["bytes"]:
            raise RlhfError(f"{self.path} is shorter than its progress record says; pass --overwrite to start again")
        with open(self.path, "r+b") as handle:  # drop anything after the last recorded batch
            handle.truncate(state["bytes"])
        self.done_items, self.rows, self.finished = state["items"], state["rows"], state.get("done", False)
        self.counters = Counter(state.get("counters", {}))

    def append(self, rows: list[dict[str, Any]], items: int, counters: dict[str, int] | None = None) -> None:
        """Write ``rows`` (the output of ``items`` more input items), then record the progress."""
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        with open(self.path, "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self.done_items += items
        self.rows += len(rows)
        self.counters.update(counters or {})
        self._record()

    def finish(self) -> None:
        self.finished = True
        self._record()

    def _record(self) -> None:
        state = {"items": self.done_items, "rows": self.rows, "bytes": self.path.stat().st_size,
                 "counters": dict(self.counters), "done": self.finished, "settings": self.settings}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_path)
