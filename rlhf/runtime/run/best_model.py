"""``--save-best METRIC[:min|max]``: the model that scored best on an eval metric, kept in ``<out>/best/``.

One rule for both loops (``rlhf train`` and the fit commands): after each eval, a finite value
strictly better than the best so far makes the model the best, written with ``best.json`` =
``{metric, value, step}``; a NaN or infinite value (an eval whose every reward was skipped) is
never best, and a tie keeps the earlier model. The best so far is part of the trainer state, so
``--resume`` keeps it and a worse eval after a resume leaves ``best/`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.runtime.config.options import best_metric


class BestModel:
    def __init__(self, spec: str | None):
        self.spec = spec
        self.metric = best_metric(spec)  # (name, "min" | "max"), or None without --save-best
        self.record: dict[str, Any] | None = None  # {"metric", "value", "step"} of the model in <out>/best

    def check(self, names: Iterable[str]) -> None:
        """A usage error (exit 2) unless the eval reports the metric (``names``: the eval's metric names)."""
        if self.metric is not None and self.metric[0] not in names:
            reported = ", ".join(sorted(k for k in names if k.startswith("eval/")))
            raise ConfigError(f"--save-best {self.spec}: the eval reports no {self.metric[0]}; it reports {reported}")

    def consider(self, evals: dict[str, float], step: int, write: Callable[[dict[str, Any]], None]) -> None:
        """After the eval of ``step`` (steps done): ``write(record)`` saves the model as the new best
        when ``evals`` holds a finite value strictly better than the best so far."""
        if self.metric is None:
            return
        self.check(evals)
        name, direction = self.metric
        value = evals[name]
        if not math.isfinite(value):
            return
        if self.record is not None:
            best = self.record["value"]
            if not (value < best if direction == "min" else value > best):
                return
        self.record = {"metric": name, "value": value, "step": step}
        write(self.record)
