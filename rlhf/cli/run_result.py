"""What a finished run hands back to its caller (the Python API, `rlhf.train(...)` and the rest):
where it is, its model, and the metrics of its last step, read from the files the run wrote.

``metrics`` merges the rows of ``metrics.jsonl`` (the built-in logger's) that share the highest
``step`` (a step's training row and the eval row written at the same step); it is empty when the
run logged no row (a run that ended before its first step, or a run with the file logger off).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunResult:
    out: Path  # the run directory
    final: Path | None  # <out>/final: the trained model (None if the run wrote none)
    best: Path | None = None  # <out>/best, with --save-best
    metrics: dict[str, Any] = field(default_factory=dict)  # the last step's metrics
    step: int | None = None  # the last logged step

    @classmethod
    def of(cls, out: Path | str) -> RunResult:
        out = Path(out)
        step, metrics = last_metrics(out / "metrics.jsonl")
        return cls(out=out, final=_dir(out / "final"), best=_dir(out / "best"), metrics=metrics, step=step)

    def __str__(self) -> str:
        return str(self.out)


def _dir(path: Path) -> Path | None:
    return path if path.is_dir() else None


def last_metrics(path: Path) -> tuple[int | None, dict[str, Any]]:
    """``(step, metrics)`` of the highest step in a metrics.jsonl file (``(None, {})`` if none)."""
    rows: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    except OSError:
        return None, {}
    if not rows:
        return None, {}
    step = max(row["step"] for row in rows)
    merged: dict[str, Any] = {}
    for row in rows:
        if row["step"] == step:
            merged.update(row)
    return step, merged
