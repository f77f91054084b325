"""``rlhf view RUN --export FILE.html``: the viewer's page as one file that needs no server and no
network (docs/runs.md): the curves, and the samples and token records of the chosen steps, inline.

``--steps`` chooses them: ``5``, ``1,5,9``, ``10-20`` or a mix (default: the last 10 steps of the
first run). The same page code runs it; its searches (the same prompt across steps and runs) look
through the steps the file holds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from rlhf.core.errors import ConfigError, RlhfError
from rlhf.viewer.page import render
from rlhf.viewer.runs import CHART_METRICS, Run

DEFAULT_LAST = 10
MAX_STEPS = 2000


def parse_steps(spec: str) -> list[int]:
    """``"1,5,10-12"`` -> ``[1, 5, 10, 11, 12]`` (refuses anything else, with the form it takes)."""
    steps: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        found = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not found:
            raise ConfigError(f"--steps {spec!r}: write steps as 5, 1,5,9 or 10-20 (or a mix: 1,10-20)")
        first, last = int(found.group(1)), int(found.group(2) or found.group(1))
        if last < first:
            raise ConfigError(f"--steps {part}: a range goes upwards (write {last}-{first})")
        if last - first + len(steps) >= MAX_STEPS:
            raise ConfigError(f"--steps {spec}: more than {MAX_STEPS} steps would make a file too large to open; "
                              "choose fewer")
        steps.update(range(first, last + 1))
    return sorted(steps)


def export_data(runs: list[Run], steps: list[int] | None) -> dict[str, Any]:
    """What the page starts from in an export: each run's curves and the chosen steps' samples."""
    chosen = steps if steps is not None else runs[0].steps()[-DEFAULT_LAST:]
    data = []
    for run in runs:
        metrics = run.metrics.columns([])
        keys = [k for k in CHART_METRICS if k in metrics["keys"]]
        data.append({**run.summary(), "metrics": run.metrics.columns(keys), "steps": run.steps(),
                     "step_data": {str(step): run.step(step) for step in chosen}})
    return {"mode": "export", "runs": data, "charts": list(CHART_METRICS), "exported_steps": chosen}


def export_html(runs: list[Run], target: Path, steps: list[int] | None = None) -> Path:
    """Write the page to ``target`` whole (temporary file, rename); returns it."""
    html = render(export_data(runs, steps))
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RlhfError(f"cannot write {target}: {exc.strerror or exc}") from exc
    return target
