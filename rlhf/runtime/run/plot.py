"""``rlhf plot RUN [RUN ...]``: a run's curves as one PNG (docs/runs.md).

One panel per metric over steps, one line per run: the values smoothed (an exponential moving
average, ``smoothing`` 0.6 by default, started at the first value) drawn strong, the raw values
faint behind them. By default the panels are the curves a run is read by, those any of the runs
logged: mean reward, KL, response length, the policy or training loss, and the eval metrics
(``eval/reward/mean``, ``eval/pass@1``, ``eval/loss``); ``--metric`` picks others (any key of
``metrics.jsonl``). Eval rows (step 0 is the eval before training) are plotted at their step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlhf.core.errors import ConfigError

DEFAULT_METRICS = ("reward/mean", "kl/mean", "response/length_mean", "policy/loss", "train/loss",
                   "eval/reward/mean", "eval/pass@1", "eval/loss")


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run}: no metrics.jsonl (a run directory holds one once a step completed)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise ConfigError(f"{path} line {number}: not valid JSON ({exc})") from None
    return rows


def series(rows: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``metric``: the rows that hold a finite number for it."""
    points = [(int(row["step"]), float(row[metric])) for row in rows
              if isinstance(row.get(metric), (int, float)) and math.isfinite(row[metric]) and "step" in row]
    return [s for s, _ in points], [v for _, v in points]


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average: s_0 = v_0, s_i = weight * s_{i-1} + (1 - weight) * v_i."""
    out: list[float] = []
    for value in values:
        out.append(value if not out else weight * out[-1] + (1 - weight) * value)
    return out


def choose_metrics(logged: set[str], metrics: list[str] | None) -> list[str]:
    """The panels: ``metrics`` (each must be logged by some run), else the `DEFAULT_METRICS` logged."""
    if metrics:
        missing = [m for m in metrics if m not in logged]
        if missing:
            from rlhf.core.errors import close_matches

            hints = "; ".join(f"{m!r}: did you mean {' or '.join(map(repr, close_matches(m, sorted(logged))))}?"
                              if close_matches(m, sorted(logged)) else f"{m!r}" for m in missing)
            raise ConfigError(f"no run logged {hints} (metrics.jsonl keys: {', '.join(sorted(logged - {'step'}))})")
        return list(metrics)
    chosen = [m for m in DEFAULT_METRICS if m in logged]
    if not chosen:
        raise ConfigError(f"none of {', '.join(DEFAULT_METRICS)} is logged; pick metrics with --metric")
    return chosen


def plot_runs(runs: list[Path], *, metrics: list[str] | None = None, out: Path | None = None,
              smoothing: float = 0.6) -> Path:
    """Write the PNG and return its path (default ``<first run>/curves.png``)."""
    if not 0 <= smoothing < 1:
        raise ConfigError(f"--smoothing must be in [0, 1); got {smoothing}")
    data = {run: read_metrics(run) for run in runs}
    chosen = choose_metrics({key for rows in data.values() for row in rows for key in row}, metrics)
    target = out or runs[0] / "curves.png"

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    columns = min(len(chosen), 3)
    rows_count = math.ceil(len(chosen) / columns)
    figure, axes = plt.subplots(rows_count, columns, figsize=(4.2 * columns, 3.0 * rows_count), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, metric in enumerate(chosen):
        axis = axes[index // columns][index % columns]
        for number, (run, rows) in enumerate(data.items()):
            steps, values = series(rows, metric)
            if not steps:
                continue
            color = colors[number % len(colors)]
            axis.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            axis.plot(steps, smooth(values, smoothing), color=color, linewidth=1.8,
                      label=run.name if len(data) > 1 else None)
        axis.set_title(metric, fontsize=10)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=8)
        axis.grid(alpha=0.3)
        if len(data) > 1 and index == 0:
            axis.legend(fontsize=8)
    for index in range(len(chosen), rows_count * columns):
        axes[index // columns][index % columns].axis("off")
    figure.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp.png")
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    tmp.replace(target)
    return target
