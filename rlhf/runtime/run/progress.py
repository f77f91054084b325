"""Progress display: a rich bar on a terminal and in a Jupyter notebook (a live widget there, for the
Python API, where ipywidgets is installed), one plain line per step otherwise (CI logs, and a
notebook without ipywidgets, where the lines render as the cell's output)."""

from __future__ import annotations

import sys
import time
from typing import Any


def _fmt(metrics: dict[str, float], key: str, spec: str) -> str:
    value = metrics.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


# (label, metric key, format) of the figures shown per step: the RL loop's by default.
RL_FIELDS = (("reward", "reward/mean", ".3f"), ("kl", "kl/mean", ".4f"), ("tok/s", "throughput/tokens_per_s", ".0f"))


def in_notebook() -> bool:
    """This process is a Jupyter kernel (IPython's ZMQ shell), where a bar renders as a widget."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _widgets_installed() -> bool:
    """rich draws a live bar in Jupyter through ipywidgets (without it, it only warns)."""
    import importlib.util

    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):
        return False


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True, stream: Any = None,
                 fields: tuple[tuple[str, str, str], ...] = RL_FIELDS):
        self.total, self.start, self.enabled, self.fields = total, start, enabled, fields
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._bar = None
        notebook = in_notebook() and _widgets_installed()
        if enabled and (notebook or getattr(self.stream, "isatty", lambda: False)()):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn

            from rich.console import Console

            self._bar = RichProgress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                                     console=Console(force_jupyter=True) if notebook else Console(file=self.stream),
                                     transient=False)
            self._task = self._bar.add_task("train", total=total, completed=start, stats="")
            self._bar.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        stats = "  ".join(f"{label} {_fmt(metrics, key, spec)}" for label, key, spec in self.fields)
        if self._bar is not None:
            self._bar.update(self._task, completed=step + 1, stats=stats)
            return
        done = step + 1 - self.start
        elapsed = time.monotonic() - self.started
        eta = elapsed / done * (self.total - step - 1) if done else 0.0
        print(f"step {step + 1}/{self.total}  {stats}  eta {eta:.0f}s", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
