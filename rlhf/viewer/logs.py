"""Reading a run's JSON-lines logs lazily, for ``rlhf view`` (docs/runs.md).

A run appends its logs in step order (metrics.jsonl, samples.jsonl, tokens.jsonl: each line a JSON
object whose first key is ``"step"``), so the lines of one step are found without reading the
file: a binary search over byte offsets, each probe reading the line that starts at or after an
offset (`StepLines`). A 10,000-step run of 100 samples a step (half a gigabyte) finds a step's
lines in about 30 reads. Only complete lines count (a run may be writing the last one); a file
that became shorter (a ``--resume`` cut it back) is read afresh.

`MetricRows` reads metrics.jsonl whole once and then only the bytes appended since, keeping the
numeric values of each row (what the curves need).
"""

from __future__ import annotations

import json
import math
import mmap
import re
import threading
from pathlib import Path
from typing import Any

_STEP = re.compile(rb'^\{\s*"step"\s*:\s*(-?\d+)')
_NO_STEP = float("inf")


def line_step(line: bytes) -> float:
    """The ``step`` of one log line (``inf`` where it has none, so it sorts last)."""
    found = _STEP.match(line)
    if found:
        return int(found.group(1))
    try:
        row = json.loads(line)
    except ValueError:
        return _NO_STEP
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else _NO_STEP


def complete_size(path: Path) -> int:
    """The length of ``path`` up to its last newline (0 when it is missing)."""
    try:
        size = path.stat().st_size
    except OSError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb") as handle:
        back = min(size, 1 << 16)
        while True:
            handle.seek(size - back)
            chunk = handle.read(back)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                return size - back + cut + 1
            if back == size:
                return 0
            back = min(size, back * 4)


class StepLines:
    """The lines of each step in one log file, found by binary search (the module docstring)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[int, int]] = {}
        self._known = (0, 0)  # (inode, size) the cache was made for

    def exists(self) -> bool:
        return self.path.is_file()

    def _check(self, end: int) -> None:
        try:
            inode = self.path.stat().st_ino
        except OSError:
            inode = 0
        if inode != self._known[0] or end < self._known[1]:
            self._cache.clear()  # another file, or one cut back: nothing cached holds
        self._known = (inode, end)

    def _line_at_or_after(self, handle: Any, offset: int, end: int) -> tuple[int, float]:
        """(start, step) of the first line that starts at or after ``offset`` (``(end, inf)``: none)."""
        if offset > 0:
            handle.seek(offset - 1)
            handle.readline()  # to the end of the line ``offset - 1`` is in
            offset = handle.tell()
        if offset >= end:
            return end, _NO_STEP
        handle.seek(offset)
        return offset, line_step(handle.readline(4096))

    def _lower_bound(self, handle: Any, step: int, end: int) -> int:
        """The start of the first line whose step is at least ``step`` (``end``: none)."""
        low, high = 0, end
        while low < high:
            middle = (low + high) // 2
            if self._line_at_or_after(handle, middle, end)[1] >= step:
                high = middle
            else:
                low = middle + 1
        return self._line_at_or_after(handle, low, end)[0]

    def span(self, step: int) -> tuple[int, int]:
        """The byte range ``[start, stop)`` of ``step``'s lines (empty when it has none)."""
        end = complete_size(self.path)
        with self._lock:
            self._check(end)
            if step in self._cache:
                return self._cache[step]
            if end == 0:
                return 0, 0
            with open(self.path, "rb") as handle:
                start = self._lower_bound(handle, step, end)
                stop = self._lower_bound(handle, step + 1, end)
            if stop < end:  # a later step follows: this one is complete, and stays so
                self._cache[step] = (start, stop)
            return start, stop

    def rows(self, step: int) -> list[dict[str, Any]]:
        """The JSON objects of ``step``'s lines (a line that is not one is left out)."""
        start, stop = self.span(step)
        if stop <= start:
            return []
        with open(self.path, "rb") as handle:
            handle.seek(start)
            data = handle.read(stop - start)
        rows = []
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def find(self, needle: bytes, limit: int) -> list[dict[str, Any]]:
        """The rows of the lines that hold ``needle`` (at most ``limit``, the latest ones)."""
        end = complete_size(self.path)
        if end == 0 or not needle:
            return []
        found: list[dict[str, Any]] = []
        with open(self.path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            at = min(end, len(data))
            while len(found) < limit:
                hit = data.rfind(needle, 0, at)
                if hit < 0:
                    break
                start = data.rfind(b"\n", 0, hit) + 1
                stop = data.find(b"\n", hit)
                stop = end if stop < 0 else stop
                try:
                    row = json.loads(data[start:stop])
                except ValueError:
                    row = None
                if isinstance(row, dict):
                    found.append(row)
                at = start
        found.reverse()
        return found


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's finite numbers (booleans aside)."""
    return {key: float(value) for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class MetricRows:
    """metrics.jsonl's rows as numbers, read once and then only what was appended."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows: list[dict[str, float]] = []
        self.keys: set[str] = set()
        self._offset, self._inode = 0, 0
        self._lock = threading.Lock()

    def refresh(self) -> list[dict[str, float]]:
        """Read what was appended since the last call (everything again where the file was cut back)."""
        with self._lock:
            end = complete_size(self.path)
            try:
                inode = self.path.stat().st_ino
            except OSError:
                inode = 0
            if end < self._offset or inode != self._inode:
                self.rows, self.keys, self._offset, self._inode = [], set(), 0, inode
            if end > self._offset:
                with open(self.path, "rb") as handle:
                    handle.seek(self._offset)
                    data = handle.read(end - self._offset)
                self._offset = end
                for line in data.splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and isinstance(row.get("step"), int):
                        values = numeric(row)
                        self.rows.append(values)
                        self.keys.update(values)
            return self.rows

    def columns(self, keys: list[str], start: int = 0) -> dict[str, Any]:
        """Rows ``start:`` as columns: ``{"rows": total, "keys": every key, "step": [...], "series": {key: [...]}}``
        (None where a row lacks the key)."""
        rows = self.refresh()
        chosen = rows[start:]
        return {"rows": len(rows), "keys": sorted(self.keys - {"step"}),
                "step": [int(row["step"]) for row in chosen],
                "series": {key: [row.get(key) for row in chosen] for key in keys}}
